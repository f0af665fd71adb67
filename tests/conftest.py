# Shared fixtures: the emulated Kubernetes cluster (`devcluster`, `devcluster_namespace`); see kvpolicy/devcluster.
pytest_plugins = ["kvpolicy.devcluster.pytest_plugin"]
