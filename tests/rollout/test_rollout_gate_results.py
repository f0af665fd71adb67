"""Which gate results the gate-results metric counts (`finished_gates`): every Job gate's, the GPU preflight's too,
once, when its result turns from absent or Running into a verdict."""

from kvpolicy.api.v1alpha1 import GateResult, GateVerdict, KVPolicyStatus, LatencyAnalysis
from kvpolicy.notify.metrics import OperatorMetrics
from kvpolicy.rollout.gates import finished_gates


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
