"""The gate tools the operator runs as Jobs: `kvpolicy gate accuracy` and `kvpolicy gate latency`."""
