"""Every gate's result reaches kvpolicy_gate_results_total: for each entry of a policy's gate registry
(rollout/gate_registry.py: the Job gates, the metrics checks, a custom check), a pass in which that gate finishes is
counted once, under the gate's name and verdict, by the reconciler (runtime/reconciler.py `_record_metrics`)."""

from __future__ import annotations

from datetime import UTC, datetime

from fake_kube import FakeKubeApi
from kvpolicy.analysis.checks import CheckVerdict, Gate, GateKind, MetricsCheck, Stage
from kvpolicy.analysis.model import Verdict
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.api.v1alpha1 import (
    Condition,
    ConditionStatus,
    GateResult,
    GateVerdict,
    KVPolicyStatus,
    LatencyAnalysis,
)
from kvpolicy.notify.metrics import OPERATOR_METRICS
from kvpolicy.rollout.gate_registry import gate_outcomes, gates_for
from kvpolicy.rollout.gates.job import JobGate
from kvpolicy.rollout.step_types import Observations, StepResult
from kvpolicy.runtime.reconciler import Reconciler
from operator_helpers import CONFIG, NAMESPACE, make_policy

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
PROMETHEUS = {"gates.latency.provider": "Prometheus", "gates.latency.prometheusURL": "http://prometheus:9090"}
CUSTOM = {"analysis": {"checks": [{"name": "aborts", "query": "sum(x{ {{ canary }} })", "range": {"max": "0.01"}}]}}


def _pass_finishing(gate: Gate) -> tuple[KVPolicyStatus, KVPolicyStatus, tuple[CheckVerdict, ...], GateVerdict]:
    """Statuses before and after a pass in which `gate` (and no other) comes to a verdict, what the pass observed,
    and that verdict."""
    before, after = KVPolicyStatus(latency=LatencyAnalysis()), KVPolicyStatus(latency=LatencyAnalysis())
    if isinstance(gate, JobGate):
        gate.set_result(before, GateResult(verdict=GateVerdict.RUNNING, job=f"{gate.name}-job"))
        gate.set_result(after, GateResult(verdict=GateVerdict.ERROR, job=f"{gate.name}-job"))
        return before, after, (), GateVerdict.ERROR
    assert isinstance(gate, MetricsCheck), f"a gate of a kind this test does not know: {gate!r}"
    if gate.stage is Stage.ANALYSIS:
        after = KVPolicyStatus(latency=LatencyAnalysis(checks=1))
        verdict = Verdict(GateVerdict.BREACH, AnalysisReason.CUSTOM_CHECK_BREACHED, "over")
    else:
        assert gate.verification is not None
        condition = Condition(
            type=gate.verification.condition,
            status=ConditionStatus.TRUE,
            reason=gate.verification.passed_event,
            last_transition_time=NOW,
        )
        after = KVPolicyStatus(latency=LatencyAnalysis(), conditions=[condition])
        verdict = Verdict(GateVerdict.PASS, gate.verification.passed_event, "as planned")
    return before, after, (CheckVerdict(gate, verdict),), verdict.kind


def _counted(gate: str, verdict: str) -> float:
    labels = {"gate": gate, "verdict": verdict}
    return OPERATOR_METRICS.registry.get_sample_value("kvpolicy_gate_results_total", labels) or 0.0


def test_every_gate_in_the_registry_reaches_the_gate_results_metric() -> None:
    policy = make_policy(**{"gates.latency.enabled": True, "gates.gpuPreflight.enabled": True, **PROMETHEUS, **CUSTOM})
    registry = gates_for(policy)
    assert {gate.kind for gate in registry} == set(GateKind)
    assert "custom/aborts" in [gate.name for gate in registry]
    reconciler = Reconciler(FakeKubeApi(), CONFIG)
    try:
        for gate in registry:
            before, after, observed, verdict = _pass_finishing(gate)
            passed = policy.model_copy(update={"status": before})
            outcomes = gate_outcomes(passed, after, observed)
            assert [(o.gate, o.verdict) for o in outcomes] == [(gate.name, verdict)], gate.name
            counted = _counted(gate.name, verdict)
            result = StepResult(status=after, actions=(), events=(), requeue_after=0)
            reconciler._record_metrics(passed, Observations(now=NOW, checks=observed), result)
            assert _counted(gate.name, verdict) == counted + 1, gate.name
            # Counted once: the next pass, from the status it left, counts nothing more.
            assert gate_outcomes(passed.model_copy(update={"status": after}), after, observed) == [], gate.name
    finally:
        OPERATOR_METRICS.forget_policy(NAMESPACE, "llama-fp8")
