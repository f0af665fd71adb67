"""What the reconciler publishes per policy after a pass (runtime/reconciler.py `_record_metrics`): the accuracy gate's
recovery beside the policy's own minRecovery, the policy's state as kvpolicy_policy_info, and a new rollout dropping
the previous gate's numbers (KVPolicyAccuracyRecoveryLow compares the two, and skips policies that rolled back)."""

from __future__ import annotations

from dataclasses import replace

from fake_kube import FakeKubeApi
from kvpolicy.analysis.checks import CheckVerdict
from kvpolicy.analysis.model import SideMetrics, Verdict
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.api.v1alpha1 import GateVerdict
from kvpolicy.notify.metrics import OPERATOR_METRICS
from kvpolicy.rollout.metric_checks import LATENCY
from kvpolicy.rollout.step_types import PodView
from kvpolicy.runtime.reconciler import Reconciler
from operator_helpers import CONFIG, NAMESPACE, Driver, gate_output, make_policy, run_to_canary, to_accuracy_gate


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


def test_the_pods_of_each_side_are_published_until_the_canary_is_gone() -> None:
    """kvpolicy_rollout_pod_info, which the dashboard joins vLLM's series to: the canary's pods and the target's own
    pods a check compared them with; a pass that observed no baseline keeps the last known; no canary, no pods."""
    reconciler = Reconciler(FakeKubeApi(), CONFIG)
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    before = driver.policy
    result = driver.tick(settle=False)
    assert result.status.canary is not None
    target_pod = PodView("llama-5c8d7b6f4-fghij", "10.0.0.7", True)

    def pods() -> set[tuple[str, str]]:
        [family] = [f for f in OPERATOR_METRICS.registry.collect() if f.name == "kvpolicy_rollout_pod_info"]
        # This policy's series only: other tests' policies of the same name in other namespaces share the registry.
        ours = [s for s in family.samples if (s.labels["namespace"], s.labels["policy"]) == (NAMESPACE, "llama-fp8")]
        return {(s.labels["role"], s.labels["pod"]) for s in ours}

    try:
        observed = replace(driver.world.observe(driver.now), baseline_pods=(target_pod,))
        reconciler._record_metrics(before, observed, result)
        expected = {("canary", pod) for pod in driver.world.pods} | {("baseline", target_pod.name)}
        assert len(expected) == 2 and pods() == expected
        reconciler._record_metrics(before, driver.world.observe(driver.now), result)
        assert pods() == expected
        gone = replace(result, status=result.status.model_copy(update={"canary": None}))
        reconciler._record_metrics(before, driver.world.observe(driver.now), gone)
        assert pods() == set()
    finally:
        OPERATOR_METRICS.forget_policy(NAMESPACE, "llama-fp8")


def test_a_latency_analysis_check_reaches_the_gate_results() -> None:
    """A metrics check is a gate too: each check the live analysis takes is counted in kvpolicy_gate_results_total
    under its entry's name, as a Job gate's record is."""
    reconciler = Reconciler(FakeKubeApi(), CONFIG)
    prometheus = {"gates.latency.provider": "Prometheus", "gates.latency.prometheusURL": "http://prometheus:9090"}
    driver = Driver(make_policy(**{"gates.accuracy.enabled": False, "gates.latency.enabled": True, **prometheus}))
    run_to_canary(driver)
    driver.tick()
    driver.world.canary_up()
    driver.tick()
    assert driver.policy.status.latency is not None and driver.policy.status.latency.started_at is not None

    def count() -> float:
        labels = {"gate": "latency", "verdict": "Pass"}
        return OPERATOR_METRICS.registry.get_sample_value("kvpolicy_gate_results_total", labels) or 0.0

    side = SideMetrics("canary", True, 100, 60.0, {0.5: 0.1, 0.95: 0.1}, {0.5: 0.01, 0.95: 0.01})
    checks = (
        CheckVerdict(LATENCY, Verdict(GateVerdict.PASS, AnalysisReason.WITHIN_THRESHOLDS, "fine", (), side, side)),
    )
    before, counted = driver.policy, count()
    result = driver.tick(60, settle=False, checks=checks)
    try:
        reconciler._record_metrics(before, replace(driver.world.observe(driver.now), checks=checks), result)
        assert count() == counted + 1
    finally:
        OPERATOR_METRICS.forget_policy(NAMESPACE, "llama-fp8")
