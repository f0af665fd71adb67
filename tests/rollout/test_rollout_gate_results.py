"""Which gate results the gate-results metric counts: every Job gate's (`finished_gates`), the GPU preflight's too,
once, when its result turns from absent or Running into a verdict; and every metrics check's the step took
(`taken_checks`)."""

from kvpolicy.analysis.checks import CheckVerdict
from kvpolicy.analysis.model import Verdict
from kvpolicy.analysis.served import CANARY_CONFIG
from kvpolicy.api.reasons import AnalysisReason, Reason
from kvpolicy.api.v1alpha1 import (
    Condition,
    ConditionStatus,
    ConditionType,
    GateResult,
    GateVerdict,
    KVPolicyStatus,
    LatencyAnalysis,
)
from kvpolicy.notify.metrics import OperatorMetrics
from kvpolicy.rollout.gates import finished_gates
from kvpolicy.rollout.metric_checks import LATENCY, taken_checks


def status(
    preflight: GateVerdict | None = None, accuracy: GateResult | None = None, probe: GateVerdict | None = None
) -> KVPolicyStatus:
    return KVPolicyStatus(
        preflight=GateResult(verdict=preflight) if preflight else None,
        accuracy=accuracy,
        latency=LatencyAnalysis(probe=GateResult(verdict=probe)) if probe else None,
    )


def counted(before: KVPolicyStatus, after: KVPolicyStatus) -> list[tuple[str, str]]:
    return [(gate.name, result.verdict) for gate, result in finished_gates(before, after)]


def test_a_preflight_verdict_is_counted_once() -> None:
    assert counted(status(), status(preflight=GateVerdict.RUNNING)) == []
    assert counted(status(preflight=GateVerdict.RUNNING), status(preflight=GateVerdict.SAFE)) == [("preflight", "Safe")]
    # A preflight skipped without a Job (no probe backend) has a verdict at once.
    assert counted(status(), status(preflight=GateVerdict.INCONCLUSIVE)) == [("preflight", "Inconclusive")]
    assert counted(status(preflight=GateVerdict.SAFE), status(preflight=GateVerdict.SAFE)) == []


def test_the_accuracy_gate_and_the_latency_probe_are_counted_as_before() -> None:
    passed = GateResult(verdict=GateVerdict.PASS, recovery=0.98, canary_score=0.9, baseline_score=0.92)
    before = status(GateVerdict.SAFE, GateResult(verdict=GateVerdict.RUNNING), GateVerdict.RUNNING)
    after = status(GateVerdict.SAFE, passed, GateVerdict.BREACH)
    assert counted(before, after) == [("accuracy", "Pass"), ("latency", "Breach")]
    assert counted(after, after) == []


def test_the_metric_gets_the_preflight_label() -> None:
    metrics = OperatorMetrics()
    for gate, result in finished_gates(status(), status(preflight=GateVerdict.UNSAFE)):
        metrics.record_gate_result("m", "llm", gate.name, result.verdict, result.recovery, None, None)
    sample = metrics.registry.get_sample_value(
        "kvpolicy_gate_results_total", {"gate": "preflight", "verdict": "Unsafe"}
    )
    assert sample == 1


# ------------------------------------------------------------------------------------ metrics checks (`taken_checks`)

CONFIG_PASS = CheckVerdict(CANARY_CONFIG, Verdict(GateVerdict.PASS, Reason.SERVED_AS_PLANNED, "fp8 as planned"))
CONFIG_WAIT = CheckVerdict(CANARY_CONFIG, Verdict(GateVerdict.NO_DATA, Reason.AWAITING_SERVED_CONFIG, "no series"))
LATENCY_BREACH = CheckVerdict(LATENCY, Verdict(GateVerdict.BREACH, AnalysisReason.TTFT_RATIO_EXCEEDED, "1.5x"))


def verified(condition: ConditionStatus | None = None, checks: int | None = None) -> KVPolicyStatus:
    """A status whose canary configuration condition is `condition`, with `checks` latency checks made."""
    found = [
        Condition(
            type=ConditionType.CANARY_CONFIG_VERIFIED,
            status=status,
            reason=Reason.SERVED_AS_PLANNED,
            last_transition_time="2026-12-02T12:00:00Z",
        )
        for status in ([condition] if condition else [])
    ]
    return KVPolicyStatus(conditions=found, latency=LatencyAnalysis(checks=checks) if checks is not None else None)


def taken(before: KVPolicyStatus, after: KVPolicyStatus, *checks: CheckVerdict) -> list[tuple[str, str]]:
    return [(result.check.name, result.verdict.kind) for result in taken_checks(before, after, checks)]


def test_a_verify_check_is_counted_once_when_it_concludes_not_while_it_waits() -> None:
    assert taken(verified(), verified(ConditionStatus.UNKNOWN), CONFIG_WAIT) == []
    assert taken(verified(ConditionStatus.UNKNOWN), verified(ConditionStatus.TRUE), CONFIG_PASS) == [
        ("canary-config", "Pass")
    ]
    assert taken(verified(ConditionStatus.TRUE), verified(ConditionStatus.TRUE), CONFIG_PASS) == []
    # A verdict the step did not act on (its condition did not move) is not counted.
    assert taken(verified(), verified(), CONFIG_PASS) == []


def test_every_analysis_check_the_analysis_folded_in_is_counted() -> None:
    assert taken(verified(checks=2), verified(checks=3), LATENCY_BREACH) == [("latency", "Breach")]
    assert taken(verified(), verified(checks=1), LATENCY_BREACH) == [("latency", "Breach")]
    assert taken(verified(checks=3), verified(checks=3), LATENCY_BREACH) == [], "not folded in: not counted"


def test_the_metric_gets_a_metrics_check_label() -> None:
    metrics = OperatorMetrics()
    for result in taken_checks(verified(ConditionStatus.UNKNOWN), verified(ConditionStatus.TRUE), [CONFIG_PASS]):
        metrics.count_gate_result(result.check.name, result.verdict.kind)
    sample = metrics.registry.get_sample_value(
        "kvpolicy_gate_results_total", {"gate": "canary-config", "verdict": "Pass"}
    )
    assert sample == 1
