"""The accuracy gate's length profile end to end: the operator under kopf against the dev cluster, a real gate Job and
simulated vLLM pods whose canary image has uncalibrated KV scales (a ~2% loss at every length)."""

from __future__ import annotations

import pytest
from e2e_helpers import KVP, PATCHED_IMAGE, OperatorFactory, event_reasons, policy, target, wait_decided
from kvpolicy.plugin import view
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.runners import EntrypointQuirk, SimulatorRunner

PROFILE = {"gates.accuracy.lengthProfile.buckets": 4}


@pytest.fixture
def shifted_image_runner(devcluster: ThreadedDevCluster) -> None:
    """The patched image has two-level accumulation, but its FP8 KV scales are 1.0 on a model that needs others."""
    shifted = EntrypointQuirk(add=("--kv-scale-error", "0.30"))
    runner = SimulatorRunner(two_level_fix_images=frozenset({PATCHED_IMAGE}), quirks={PATCHED_IMAGE: shifted})
    devcluster.set_runner(runner)


def test_a_systematic_shift_behind_a_pass_is_a_warning_and_shown_per_bucket(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, shifted_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, **PROFILE))
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "Promoted", status
    profile = status["accuracy"]["profile"]
    assert [bucket["lengthTokens"] for bucket in profile["buckets"]] == [2048, 4096, 8192, 16384]
    assert profile["systematicShift"] is True, profile
    assert "SystematicShift" in event_reasons(devcluster, ns)
    condition = next(c for c in status["conditions"] if c["type"] == "AccuracyGatePassed")
    assert (condition["status"], condition["reason"]) == ("True", "SystematicShift")
    assert "calibrate them" in condition["message"]
    screen = view.render_get(devcluster.get(*KVP, "llama-fp8", ns), [], view.parse_timestamp(status["phaseEnteredAt"]))
    assert "systematic shift: canary below baseline in 4/4 buckets" in screen


def test_on_systematic_shift_fail_rolls_the_shifted_canary_back(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, shifted_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, **PROFILE, **{"gates.accuracy.lengthProfile.onSystematicShift": "Fail"}))
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    assert status["decision"]["reason"] == "AccuracySystematicShift"
    assert status["accuracy"]["verdict"] == "Pass", "the decision at the gate length is still the gate's"
