"""GPU facts that change after planning, on the dev cluster: the pool's nodes carry no GPU labels when the policy is
planned (GPU Feature Discovery not done yet), get them, and are relabelled from Hopper to Ampere mid-rollout."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
from e2e_helpers import KVP, OperatorFactory, event_reasons, policy, ready_pods, target, wait_phase, wait_until
from kvpolicy.planning.gpu import KNOWN_PRODUCTS
from kvpolicy_dev.devcluster import ThreadedDevCluster

NODE = "h200-0"  # the dev cluster's h200 pool, where the target runs
GPU_LABEL_PREFIX = "nvidia.com/gpu."


def gpu_labels(cluster: ThreadedDevCluster) -> dict[str, str]:
    labels = cluster.get("v1", "Node", NODE)["metadata"]["labels"]
    return {key: value for key, value in labels.items() if key.startswith(GPU_LABEL_PREFIX)}


def relabel(cluster: ThreadedDevCluster, labels: Mapping[str, str | None]) -> None:
    cluster.patch("v1", "Node", NODE, {"metadata": {"labels": dict(labels)}})


@pytest.fixture
def node_labels(devcluster: ThreadedDevCluster) -> Iterator[dict[str, str]]:
    """The node's GPU labels as the session cluster has them; put back whatever the test does to them."""
    original = gpu_labels(devcluster)
    try:
        yield original
    finally:
        relabel(devcluster, {**dict.fromkeys(gpu_labels(devcluster)), **original})


def decision_reason(cluster: ThreadedDevCluster, namespace: str) -> str | None:
    status = cluster.get(*KVP, "llama-fp8", namespace).get("status", {})
    reason: str | None = (status.get("decision") or {}).get("reason")
    return reason


def test_gpu_labels_that_appear_and_change_after_planning_plan_the_rollout_again(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, node_labels: dict[str, str]
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    wait_until(lambda: ready_pods(devcluster, ns, "app=llama"), "the target's pod")
    relabel(devcluster, dict.fromkeys(node_labels))  # GPU Feature Discovery has not labelled the node yet
    with operator():
        devcluster.create(policy(ns))
        wait_phase(devcluster, ns, {"HeldBF16"})
        assert decision_reason(devcluster, ns) == "UnknownGPU"

        relabel(devcluster, node_labels)  # the labels appear: H200
        wait_phase(devcluster, ns, {"AccuracyGate"})
        # The plan is run again at the same generation, so its children carry the run: llama-fp8-canary-g1r2.
        assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") != []

        a100 = {**KNOWN_PRODUCTS["A100"], "nvidia.com/gpu.family": "ampere"}
        relabel(devcluster, a100)  # mid-rollout: the pool is now Ampere
        held = wait_phase(devcluster, ns, {"HeldBF16"})
    assert held["status"]["decision"]["reason"] == "NoFP8TensorCores", held["status"]
    assert held["status"]["gpu"]["product"] == "NVIDIA-A100-SXM4-80GB"
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []
    jobs = devcluster.list("batch/v1", "Job", ns)
    assert [job for job in jobs if not job["metadata"].get("deletionTimestamp")] == [], "the running gate Job went"
    changes = [
        event
        for event in devcluster.list("v1", "Event", ns)
        if event["reason"] == "GPUChanged" and event["involvedObject"]["name"] == "llama-fp8"
    ]
    assert len(changes) == 2 and {event["type"] for event in changes} == {"Warning"}
    reasons = event_reasons(devcluster, ns)
    assert reasons.index("GPUChanged") > reasons.index("HeldBF16")
