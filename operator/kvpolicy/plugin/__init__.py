"""`kubectl kvpolicy`: the kubectl plugin (console script `kubectl-kvpolicy`)."""
