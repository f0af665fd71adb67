"""The latency probe gate (Synthetic traffic): a Job runs `kvpolicy gate latency` (gate_programs/latency.py), which
sends the same prompts to the canary and the baseline and compares their TTFT and ITL. Its judgement feeds the
LatencyAnalysis phase (latency_phase.py) rather than a phase of its own."""

from __future__ import annotations

from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import (
    AnalysisPhase,
    ConditionStatus,
    ConditionType,
    GateResult,
    GateVerdict,
    KVPolicySpec,
    KVPolicyStatus,
    Phase,
)
from kvpolicy.gate_programs.report import GateReport
from kvpolicy.planning.planner import GATE_LATENCY
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.gates.job import JobGate, JobInputs, Judgement, Then, no_verdict, readable, tool_job
from kvpolicy.rollout.step_types import JobView


def lengths(spec: KVPolicySpec) -> list[int]:
    """Prompt lengths the latency probe fits its curves over (at least three): spread up to the longest prompt."""
    longest = spec.capped_accuracy_length
    found = {max(1, longest // 16), max(1, longest // 4), min(spec.workload.typical_tokens, longest), longest}
    return sorted(found)


def command(spec: KVPolicySpec, canary_url: str, baseline_url: str) -> list[str]:
    latency = spec.gates.latency
    longest = spec.capped_accuracy_length
    workload = sorted({min(spec.workload.typical_tokens, longest), longest})
    return [
        "kvpolicy",
        "gate",
        "latency",
        "--canary",
        canary_url,
        "--baseline",
        baseline_url,
        "--model",
        spec.model.served_model_name,
        "--lengths",
        *[str(length) for length in lengths(spec)],
        "--workload-lengths",
        *[str(length) for length in workload],
        "--ttft-max-ratio",
        latency.ttft_max_ratio,
        "--itl-max-ratio",
        latency.itl_max_ratio,
        # Load matching: the canary carries what a baseline pod serves its users, per canary pod (latency.py).
        "--canary-pods",
        str(spec.rollout.canary_replicas),
        *b.api_key_args(spec),
    ]


_PROBE_VERDICTS = (GateVerdict.PASS, GateVerdict.BREACH, GateVerdict.INCONCLUSIVE)


def _probe_job(inputs: JobInputs) -> b.GateJob:
    return tool_job(inputs, command, inputs.spec.gates.latency.inconclusive_deadline_seconds)


def _probe_record(spec: KVPolicySpec, view: JobView, report: GateReport) -> GateResult:
    if readable(report, _PROBE_VERDICTS):
        return GateResult(verdict=report.verdict, reason=report.reason, message=report.message)
    return GateResult(
        verdict=GateVerdict.ERROR,
        reason=report.reason,
        message=f"latency probe Job {view.name} ended without a verdict ({no_verdict(view, report)})",
    )


def _probe_timed_out(spec: KVPolicySpec) -> GateResult:
    return GateResult(
        verdict=GateVerdict.INCONCLUSIVE,
        reason=DecisionReason.LATENCY_PROBE_TIMEOUT,
        message="the latency probe did not finish",
    )


def _probe_judge(spec: KVPolicySpec, result: GateResult) -> Judgement:
    message = result.message
    if result.verdict.phase is AnalysisPhase.SUCCESSFUL:
        return Judgement(Then.ADVANCE, ConditionStatus.TRUE, Reason.PROBE_WITHIN_THRESHOLDS, message)
    if result.verdict.phase is AnalysisPhase.FAILED:
        return Judgement(Then.ROLLBACK, ConditionStatus.FALSE, DecisionReason.LATENCY_BREACH, message)
    timed_out = result.reason == DecisionReason.LATENCY_PROBE_TIMEOUT
    reason = DecisionReason.LATENCY_PROBE_TIMEOUT if timed_out else DecisionReason.LATENCY_INCONCLUSIVE
    return Judgement(Then.INCONCLUSIVE, ConditionStatus.UNKNOWN, reason, message)


def _set_result(status: KVPolicyStatus, result: GateResult | None) -> None:
    if status.latency is not None:
        status.latency.probe = result


LATENCY_PROBE = JobGate(
    name="latency",
    label=GATE_LATENCY,
    phase=Phase.LATENCY_ANALYSIS,
    condition=ConditionType.LATENCY_GATE_PASSED,
    runs=lambda spec, plan: GATE_LATENCY in plan.gates,
    build=_probe_job,
    deadline_seconds=lambda spec: spec.gates.latency.inconclusive_deadline_seconds,
    record=_probe_record,
    timed_out=_probe_timed_out,
    judge=_probe_judge,
    result=lambda status: status.latency.probe if status.latency else None,
    set_result=_set_result,
)
