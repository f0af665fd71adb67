"""What the reconciler publishes per policy after a pass (runtime/reconciler.py `_record_metrics`): the accuracy gate's
recovery beside the policy's own minRecovery, the policy's state as kvpolicy_policy_info, and a new rollout dropping
the previous gate's numbers (KVPolicyAccuracyRecoveryLow compares the two, and skips policies that rolled back)."""

from __future__ import annotations

from dataclasses import replace

from fake_kube import FakeKubeApi
from kvpolicy.notify.metrics import OPERATOR_METRICS
from kvpolicy.runtime.reconciler import Reconciler
from operator_helpers import CONFIG, NAMESPACE, Driver, gate_output, make_policy, to_accuracy_gate


def sample(name: str, **labels: str) -> float | None:
    return OPERATOR_METRICS.registry.get_sample_value(name, {"namespace": NAMESPACE, "policy": "llama-fp8", **labels})


def test_a_failed_accuracy_gate_publishes_the_policys_min_recovery_and_its_rollback() -> None:
    reconciler = Reconciler(FakeKubeApi(), CONFIG)
    driver = Driver(make_policy(**{"gates.accuracy.minRecovery": "0.9"}))
    to_accuracy_gate(driver)
    before = driver.policy
    driver.world.finish_job("accuracy", gate_output("Fail", recovery=0.5, canary_score=0.4, baseline_score=0.8))
    result = driver.tick(settle=False)
    assert result.status.phase == "RollingBack"
    try:
        reconciler._record_metrics(before, driver.world.observe(driver.now), result)
        assert sample("kvpolicy_gate_recovery_ratio", gate="accuracy") == 0.5
        assert sample("kvpolicy_gate_min_recovery_ratio", gate="accuracy") == 0.9
        info = {
            "phase": "RollingBack",
            "kv_cache": "FP8",
            "gpu": "NVIDIA-H200",
            "target": "Deployment/llama",
            "decision": "RolledBack",
            "reason": "AccuracyRecoveryBelowMinimum",
        }
        assert sample("kvpolicy_policy_info", **info) == 1

        # A retry starts a new rollout, which clears the gate's result: its old numbers go with it.
        rolled_back = driver.policy
        retried = rolled_back.model_copy(update={"status": rolled_back.status.model_copy(update={"accuracy": None})})
        reconciler._record_metrics(
            rolled_back, driver.world.observe(driver.now), replace(result, status=retried.status)
        )
        assert sample("kvpolicy_gate_recovery_ratio", gate="accuracy") is None
        assert sample("kvpolicy_gate_min_recovery_ratio", gate="accuracy") is None
    finally:
        OPERATOR_METRICS.forget_policy(NAMESPACE, "llama-fp8")
