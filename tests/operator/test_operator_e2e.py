"""End-to-end rollouts: the operator under kopf against the dev cluster, simulated vLLM pods and real gate Jobs."""

from __future__ import annotations

import pytest
from conftest import OperatorFactory
from e2e_helpers import PATCHED_IMAGE, TARGET_IMAGE, container, event_reasons, policy, target, wait_phase
from kvpolicy.devcluster import SimulatorRunner, ThreadedDevCluster


@pytest.fixture
def fixed_image_runner(devcluster: ThreadedDevCluster) -> None:
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))


def test_hopper_with_the_fixed_image_is_promoted(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns))
        done = wait_phase(devcluster, ns, {"Promoted", "RolledBack", "HeldBF16"})
    assert done["status"]["phase"] == "Promoted", done["status"]
    deployed = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert deployed["image"] == PATCHED_IMAGE
    assert deployed["args"][-4:] == ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]
    accuracy = done["status"]["accuracy"]
    assert accuracy["verdict"] == "Pass" and accuracy["recovery"] >= 0.95
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []
    reasons = event_reasons(devcluster, ns)
    for reason in ("Planned", "CanaryReady", "AccuracyGatePassed", "TrafficJoined", "Promoting", "Promoted"):
        assert reason in reasons
    assert {c["type"]: c["status"] for c in done["status"]["conditions"]}["Promoted"] == "True"


def test_hopper_with_an_unfixed_image_is_rolled_back(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns))
        done = wait_phase(devcluster, ns, {"Promoted", "RolledBack", "HeldBF16"})
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    assert status["decision"]["reason"] == "AccuracyRecoveryBelowMinimum"
    assert "accuracy recovery" in status["decision"]["message"]
    deployed = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert deployed["image"] == TARGET_IMAGE and "--kv-cache-dtype" not in deployed["args"]
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []
    assert "AccuracyGateFailed" in event_reasons(devcluster, ns)
