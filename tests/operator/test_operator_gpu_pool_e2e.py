"""Which GPUs a policy plans for, on the dev cluster (five GPU pools): a target placed by required node affinity is
planned for the nodes that affinity admits, and a pool mixing Hopper and Blackwell gets no Hopper-only backend."""

from __future__ import annotations

from typing import Any

from e2e_helpers import KVP, OperatorFactory, policy, target, wait_until
from kvpolicy_dev.devcluster import POOL_LABEL, ThreadedDevCluster


def _placed_by_affinity(namespace: str, *pools: str) -> dict[str, Any]:
    deployment = target(namespace)
    pod_spec = deployment["spec"]["template"]["spec"]
    del pod_spec["nodeSelector"]
    pod_spec["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": POOL_LABEL, "operator": "In", "values": [*pools]}]}]
            }
        }
    }
    return deployment


def _planned(cluster: ThreadedDevCluster, namespace: str) -> dict[str, Any]:
    def plan() -> dict[str, Any] | None:
        status = cluster.get(*KVP, "llama-fp8", namespace).get("status") or {}
        return status if status.get("plan") and status.get("gpu") else None

    found: dict[str, Any] = wait_until(plan, "a plan")
    return found


def test_a_target_placed_by_node_affinity_is_planned_for_the_nodes_it_admits(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.create(_placed_by_affinity(ns, "b200"))
    with operator():
        devcluster.create(policy(ns))
        status = _planned(devcluster, ns)
    assert status["gpu"]["generation"] == "Blackwell", status["gpu"]
    assert status["gpu"]["nodes"] == 1 and not status["gpu"].get("mixed")
    assert status["plan"]["kvCacheDtype"] == "FP8"


def test_a_pool_mixing_hopper_and_blackwell_is_not_given_a_hopper_only_backend(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.create(_placed_by_affinity(ns, "h200", "b200"))
    with operator():
        devcluster.create(policy(ns))
        status = _planned(devcluster, ns)
    assert status["gpu"]["poolCapabilities"] == ["9.0", "10.0"], status["gpu"]
    assert status["plan"]["kvCacheDtype"] == "BF16"
    codes = [reason["code"] for reason in status["plan"]["reasons"]]
    assert "NoFP8AttentionBackend" in codes, codes
    assert "--attention-backend" not in (status["plan"].get("extraArgs") or [])
