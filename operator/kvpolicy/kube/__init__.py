"""The only code that talks to the Kubernetes API server: the client, watches, login, leader election, Secret and
ConfigMap references, the observer that gathers a pass's observations, and the executor that applies the actions."""
