"""The accuracy gate: a Job runs `kvpolicy gate accuracy` (gate_programs/accuracy.py), which compares the canary's
long-context recall with the baseline's and reports the canary's recovery."""

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
    OnSystematicShift,
    Phase,
)
from kvpolicy.gate_programs.report import GateReport
from kvpolicy.planning.planner import GATE_ACCURACY
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.gates.job import Decided, JobGate, JobInputs, Judgement, Then, no_verdict, readable, tool_job
from kvpolicy.rollout.step_types import Event, JobView


def command(spec: KVPolicySpec, canary_url: str, baseline_url: str) -> list[str]:
    accuracy = spec.gates.accuracy
    return [
        "kvpolicy",
        "gate",
        "accuracy",
        "--canary",
        canary_url,
        "--baseline",
        baseline_url,
        "--length",
        str(spec.capped_accuracy_length),
        "--model",
        spec.model.served_model_name,
        "--min-recovery",
        accuracy.min_recovery,
        "--confidence",
        accuracy.confidence,
        "--max-samples",
        str(accuracy.max_samples),
        "--baseline-floor",
        accuracy.baseline_floor,
        "--length-buckets",
        str(accuracy.length_profile.buckets),
        "--task",
        accuracy.task.value,
        "--prompt-format",
        accuracy.prompt_format.value,
        "--mrcr-needles",
        str(accuracy.mrcr_needles),
        *_baseline_pace_args(spec),
        *b.api_key_args(spec),
    ]


def _baseline_pace_args(spec: KVPolicySpec) -> list[str]:
    """The accuracy gate's pace on the production pods behind the baseline Service (gate_programs/pacing.py)."""
    rate = spec.gates.accuracy.baseline_requests_per_minute
    return ["--baseline-requests-per-minute", str(rate)] if rate is not None else []


_ACCURACY_VERDICTS = (GateVerdict.PASS, GateVerdict.FAIL, GateVerdict.INCONCLUSIVE)


def _accuracy_job(inputs: JobInputs) -> b.GateJob:
    return tool_job(inputs, command, inputs.spec.gates.accuracy.timeout_seconds)


def _accuracy_record(spec: KVPolicySpec, view: JobView, report: GateReport) -> GateResult:
    if not readable(report, _ACCURACY_VERDICTS):
        return GateResult(
            verdict=GateVerdict.ERROR,
            reason=DecisionReason.ACCURACY_GATE_ERROR,
            message=f"the accuracy gate Job {view.name} failed without a verdict ({no_verdict(view, report)})",
        )
    return GateResult(
        verdict=report.verdict,
        reason=report.reason,
        message=report.message,
        length_tokens=report.length_tokens,
        samples=report.samples,
        canary_score=report.canary_score,
        baseline_score=report.baseline_score,
        recovery=report.recovery,
        recovery_low=report.recovery_low,
        recovery_high=report.recovery_high,
        profile=report.profile,
        task=report.task,
        prompt_format=report.prompt_format,
    )


def _accuracy_timed_out(spec: KVPolicySpec) -> GateResult:
    return GateResult(
        verdict=GateVerdict.ERROR,
        reason=DecisionReason.ACCURACY_GATE_TIMEOUT,
        message=f"the accuracy gate gave no verdict within {spec.gates.accuracy.timeout_seconds} s",
    )


def _recovery_text(result: GateResult, min_recovery: str) -> str:
    if result.recovery is None:
        return result.message or "no recovery measured"
    interval = ""
    if result.recovery_low is not None and result.recovery_high is not None:
        interval = f" (interval {result.recovery_low:.2f}-{result.recovery_high:.2f})"
    return (
        f"accuracy recovery {result.recovery:.2f}{interval} against minRecovery {min_recovery} at "
        f"{result.length_tokens or '?'} tokens over {result.samples or '?'} samples"
    )


def _shift_judgement(spec: KVPolicySpec, result: GateResult, text: str) -> Judgement:
    """A pass whose length profile shows a systematic shift. The decision at the gate's length is the gate's (a
    pass); what the shift does is the user's choice (lengthProfile.onSystematicShift): Warn passes with a Warning
    event and the finding in the condition, Fail rolls back."""
    profile = result.profile
    assert profile is not None and profile.systematic_shift
    finding = (
        f"{text}, but the canary is below the baseline in all {len(profile.buckets)} length buckets (sign test "
        f"p = {profile.shift_p_value}, AUC recovery {profile.auc_recovery}): a systematic shift, as uncalibrated KV "
        f"scales give; calibrate them (an LLM-Compressor checkpoint with KV scales, kvCache.scales Calibrated: vLLM "
        f"0.32 has no --calculate-kv-scales)"
    )
    event = Event("Warning", Reason.SYSTEMATIC_SHIFT, finding)
    if spec.gates.accuracy.length_profile.on_systematic_shift == OnSystematicShift.FAIL:
        decided = Decided(DecisionReason.ACCURACY_SYSTEMATIC_SHIFT, finding)
        return Judgement(Then.ROLLBACK, ConditionStatus.FALSE, Reason.SYSTEMATIC_SHIFT, finding, event, decided)
    return Judgement(Then.ADVANCE, ConditionStatus.TRUE, Reason.SYSTEMATIC_SHIFT, finding, event)


def _accuracy_judge(spec: KVPolicySpec, result: GateResult) -> Judgement:
    text = _recovery_text(result, spec.gates.accuracy.min_recovery)
    passed = result.verdict.phase is AnalysisPhase.SUCCESSFUL
    if passed and result.profile is not None and result.profile.systematic_shift:
        return _shift_judgement(spec, result, text)
    if passed:
        event = Event("Normal", Reason.ACCURACY_GATE_PASSED, text)
        return Judgement(Then.ADVANCE, ConditionStatus.TRUE, Reason.RECOVERY_ABOVE_MINIMUM, text, event)
    if result.verdict.phase is AnalysisPhase.FAILED:
        return Judgement(
            Then.ROLLBACK,
            ConditionStatus.FALSE,
            Reason.RECOVERY_BELOW_MINIMUM,
            text,
            Event("Warning", Reason.ACCURACY_GATE_FAILED, text),
            Decided(DecisionReason.ACCURACY_RECOVERY_BELOW_MINIMUM, text),
        )
    if result.verdict.phase is AnalysisPhase.INCONCLUSIVE:
        return Judgement(
            Then.ROLLBACK,
            ConditionStatus.UNKNOWN,
            DecisionReason.ACCURACY_INCONCLUSIVE,
            text,
            Event("Warning", Reason.ACCURACY_GATE_INCONCLUSIVE, text),
            Decided(DecisionReason.ACCURACY_INCONCLUSIVE, f"the accuracy gate could not vouch for FP8: {text}"),
        )
    if result.reason == DecisionReason.ACCURACY_GATE_TIMEOUT:
        return Judgement(
            Then.ROLLBACK,
            ConditionStatus.FALSE,
            DecisionReason.ACCURACY_GATE_TIMEOUT,
            f"no verdict within {spec.gates.accuracy.timeout_seconds} s",
            decision=Decided(DecisionReason.ACCURACY_GATE_TIMEOUT, result.message),
        )
    return Judgement(Then.ROLLBACK, ConditionStatus.FALSE, DecisionReason.ACCURACY_GATE_ERROR, result.message)


def _set_result(status: KVPolicyStatus, result: GateResult | None) -> None:
    status.accuracy = result


ACCURACY = JobGate(
    name="accuracy",
    label=GATE_ACCURACY,
    phase=Phase.ACCURACY_GATE,
    condition=ConditionType.ACCURACY_GATE_PASSED,
    runs=lambda spec, plan: GATE_ACCURACY in plan.gates,
    build=_accuracy_job,
    deadline_seconds=lambda spec: spec.gates.accuracy.timeout_seconds,
    record=_accuracy_record,
    timed_out=_accuracy_timed_out,
    judge=_accuracy_judge,
    result=lambda status: status.accuracy,
    set_result=_set_result,
    min_recovery=lambda spec: float(spec.gates.accuracy.min_recovery),
    sample_cap=lambda spec: spec.gates.accuracy.max_samples,
)
