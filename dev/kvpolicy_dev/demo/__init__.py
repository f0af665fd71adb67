"""`kvpolicy demo`: the whole rollout loop on one machine.

An emulated API server and kubelet, simulated vLLM servers on GPU pools, Prometheus when installed, and the operator
run as local processes; the example KVPolicies are applied to them, progress is shown live, and a decision table plus
a Markdown report with plots are written at the end. Every decision shown comes from a KVPolicy's status.
"""
