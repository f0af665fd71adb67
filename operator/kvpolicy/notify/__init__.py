"""What the operator tells the outside world: webhook notifications and its own Prometheus metrics."""
