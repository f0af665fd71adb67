"""A ReplicaRatio canary joins the users' traffic with the pods its accuracy gate judged (issue 23 item 6), on the
emulated cluster: the operator labels the running pods; the canary's template, its ReplicaSet and its pods stay, so
no pod reloads the model and is judged cold."""

from __future__ import annotations

from typing import Any

from e2e_helpers import OperatorFactory, policy, ready_pods, target, users, wait_phase, wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster


def uids(pods: list[dict[str, Any]]) -> set[str]:
    return {str(pod["metadata"]["uid"]) for pod in pods}


def test_the_pods_that_passed_the_accuracy_gate_are_the_ones_that_join_the_users_service(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, **{"rollout.approval": "Manual", "rollout.canaryReplicas": 2}))
        wait_phase(devcluster, ns, {"AccuracyGate"})
        judged = ready_pods(devcluster, ns, "kvpolicy.dev/role=canary")
        assert len(judged) == 2
        with users(devcluster, ns) as generator:
            wait_phase(devcluster, ns, {"AwaitingApproval"})
            joined = ready_pods(devcluster, ns, "kvpolicy.dev/role=canary,app=llama")
            # The users' requests reach the joined pods: the Service's selector (app=llama) picks them.
            urls = {f"http://{pod['status']['podIP']}:8000" for pod in joined}
            counters = generator.counters["llama"]
            wait_until(lambda: any(counters.by_endpoint.get(url, 0) for url in urls), "a user request to the canary")
    assert uids(joined) == uids(judged), "the same pods, warm, serve the users"
    canary = devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary")
    (deployment,) = canary
    assert "app" not in deployment["spec"]["template"]["metadata"]["labels"], "the template is not changed"
    replica_sets = devcluster.list("apps/v1", "ReplicaSet", ns, "kvpolicy.dev/role=canary")
    assert len(replica_sets) == 1, "no second ReplicaSet: nothing was rolled"
