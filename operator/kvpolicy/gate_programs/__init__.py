"""The programs the gate Jobs run: `kvpolicy gate accuracy` and `kvpolicy gate latency`, and the report every gate
writes. They run in the Job's pod and carry no controller code."""
