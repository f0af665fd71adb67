"""The pure rollout core: one `step(policy, observations) -> (status, actions, events)` per pass, the gate and
check tables it decides with, the manifest builders. No I/O: no Kubernetes client, no HTTP, no kopf (.importlinter)."""
