"""The operator process: `kvpolicy run`, the supervisor around kopf, the kopf handlers and the per-policy loop."""
