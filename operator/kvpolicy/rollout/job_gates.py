"""The Job gates, one table entry each (after Argo Rollouts' job metric provider): how its Job is built, how long it may
run, how its report becomes a status record, and how that record becomes a transition.

The step runs every entry the same way (`tick.run_job`): create the Job if it is missing, time it out past its
deadline, read its `GateReport` when it has finished. A gate of its own phase (GPU preflight, accuracy) then moves
the rollout on as its `Judgement` says; the latency probe's judgement feeds the latency phase instead.

A gate may decline to run its Job for a plan (`skip`): its judgement then moves the rollout on at once.

Adding a gate: an entry in `PHASE_GATES` (in the order the gates run), its command builder in builders.py, and in
api/v1alpha1.py its spec fields, its status field and its `Phase`.

Pure: nothing here reads the cluster or the state machine, so observe and the spec-derived rules can use the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

from kvpolicy.api.reasons import REPORT_PROBLEMS, DecisionReason, Reason
from kvpolicy.api.v1alpha1 import (
    ConditionStatus,
    ConditionType,
    GateResult,
    GateVerdict,
    KVPolicySpec,
    KVPolicyStatus,
    OnSystematicShift,
    Phase,
    Plan,
)
from kvpolicy.gate_programs.report import GateReport
from kvpolicy.planning.attention import PROBE_BACKENDS
from kvpolicy.planning.planner import GATE_ACCURACY, GATE_LATENCY, GATE_PREFLIGHT
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.step_types import Event, JobView, Obj, StepConfig


@dataclass(frozen=True)
class JobInputs:
    """What a gate Job is built from."""

    spec: KVPolicySpec
    config: StepConfig
    name: str
    pod_spec: Obj  # the target's serving pods': the GPU Jobs share their pool and their images' registry
    plan: Plan
    canary_url: str
    baseline_url: str


class Then(Enum):
    """What a gate's record does to the rollout."""

    ADVANCE = auto()  # on to the next phase (for the latency probe: promote after the bake)
    ROLLBACK = auto()
    INCONCLUSIVE = auto()  # the phase's onInconclusive decides (latency probe only)


@dataclass(frozen=True)
class Decided:
    """The decision a rollback takes."""

    reason: str
    message: str


@dataclass(frozen=True)
class Judgement:
    """A gate record's transition: the gate's condition, an event, and what happens next. A rollback decides with
    `decision`, else with the condition's reason and message."""

    then: Then
    status: ConditionStatus
    reason: str
    message: str
    event: Event | None = None
    decision: Decided | None = None

    @property
    def decided(self) -> Decided:
        return self.decision or Decided(self.reason, self.message)


@dataclass(frozen=True)
class JobGate:
    # The Job's name part (<policy>-<name>-g<generation>), and the gate label of kvpolicy_gate_results_total that
    # the alert rules match on.
    name: str
    phase: Phase
    condition: ConditionType
    runs: Callable[[KVPolicySpec, Plan], bool]
    build: Callable[[JobInputs], b.GateJob]
    deadline_seconds: Callable[[KVPolicySpec], int]
    record: Callable[[KVPolicySpec, JobView, GateReport], GateResult]
    timed_out: Callable[[KVPolicySpec], GateResult]
    judge: Callable[[KVPolicySpec, GateResult], Judgement]
    result: Callable[[KVPolicyStatus], GateResult | None]
    set_result: Callable[[KVPolicyStatus, GateResult | None], None]
    skip: Callable[[Plan], GateResult | None] = lambda plan: None  # a record made without a Job, when it cannot run
    # The least recovery the gate accepts (kvpolicy_gate_min_recovery_ratio, which KVPolicyAccuracyRecoveryLow compares
    # the recovery with); None for a gate that measures no recovery.
    min_recovery: Callable[[KVPolicySpec], float | None] = lambda spec: None


def _readable(report: GateReport, verdicts: tuple[GateVerdict, ...]) -> bool:
    return report.reason not in REPORT_PROBLEMS and report.verdict in verdicts


def _no_verdict(view: JobView, report: GateReport) -> str:
    """How a gate Job without a verdict ended, and the last its pod said (the report's problem quotes the tail of a
    crashed tool's log): "exit code 1 (Error): the gate's output is no report: '...ConnectionError...'"."""
    ended = [view.failure_reason] if view.failure_reason else []
    if view.exit_code is not None:
        reason = f" ({view.terminated_reason})" if view.terminated_reason else ""
        ended.append(f"exit code {view.exit_code}{reason}")
    return f"{', '.join(ended) or 'no verdict'}: {report.message}" if report.message else ", ".join(ended)


def _tool_job(inputs: JobInputs, command: Callable[[KVPolicySpec, str, str], list[str]], timeout: int) -> b.GateJob:
    """A Job running one of the operator image's gate tools against the canary and baseline Services."""
    return b.GateJob(
        name=inputs.name,
        role=b.ROLE_GATE,
        image=inputs.config.gate_image,
        command=command(inputs.spec, inputs.canary_url, inputs.baseline_url),
        timeout_seconds=timeout,
        resources=inputs.config.gate_resources,
        pod_placement={},
        image_pull_secrets=b.image_pull_secrets(inputs.pod_spec),
        env=b.api_key_env(inputs.spec),
    )


# ---------------------------------------------------------------------------------------------------- GPU preflight


def _probe_backend(plan: Plan) -> str | None:
    return PROBE_BACKENDS.get(plan.attention_backend or "")


def _preflight_not_probed(plan: Plan) -> GateResult | None:
    if _probe_backend(plan) is not None:
        return None
    backend = plan.attention_backend or "vLLM's default"
    message = (
        f"not probed: the canary runs attention backend {backend}, and kvkernels.probe has no backend that measures "
        f"it (probed: {', '.join(sorted(PROBE_BACKENDS))})"
    )
    return GateResult(verdict=GateVerdict.INCONCLUSIVE, reason=Reason.PREFLIGHT_NOT_PROBED, message=message)


def _preflight_job(inputs: JobInputs) -> b.GateJob:
    backend = _probe_backend(inputs.plan)
    assert backend is not None, "a plan without a probe backend skips the preflight Job (_preflight_not_probed)"
    return b.GateJob(
        name=inputs.name,
        role=b.ROLE_PREFLIGHT,
        image=inputs.spec.gates.gpu_preflight.image or inputs.config.probe_image,
        command=b.preflight_command(inputs.spec, backend),
        timeout_seconds=inputs.spec.rollout.progress_deadline_seconds,
        resources=b.with_one_gpu(inputs.config.preflight_resources),
        pod_placement=b.pod_placement(inputs.pod_spec),
        image_pull_secrets=b.image_pull_secrets(inputs.pod_spec),
        env=b.PREFLIGHT_ENV,
    )


def _preflight_record(spec: KVPolicySpec, view: JobView, report: GateReport) -> GateResult:
    if _readable(report, (GateVerdict.SAFE,)):
        return GateResult(verdict=GateVerdict.SAFE, reason=Reason.ACCUMULATION_SAFE, message=report.message)
    if _readable(report, (GateVerdict.UNSAFE,)):
        text = report.message or f"the probe found FP8 accumulation losing accuracy by {spec.accuracy_length} tokens"
        return GateResult(verdict=GateVerdict.UNSAFE, reason=Reason.ACCUMULATION_UNSAFE, message=text)
    return GateResult(
        verdict=GateVerdict.INCONCLUSIVE,
        reason=Reason.PREFLIGHT_INCONCLUSIVE,
        message=f"the probe could not run ({_no_verdict(view, report)})",
    )


def _preflight_timed_out(spec: KVPolicySpec) -> GateResult:
    return GateResult(
        verdict=GateVerdict.INCONCLUSIVE,
        reason=Reason.PREFLIGHT_TIMED_OUT,
        message="the probe did not finish (no free GPU in the pool?)",
    )


def _preflight_judge(spec: KVPolicySpec, result: GateResult) -> Judgement:
    message = result.message
    if result.verdict == GateVerdict.SAFE:
        return Judgement(
            Then.ADVANCE,
            ConditionStatus.TRUE,
            Reason.ACCUMULATION_SAFE,
            message or "the probe found no accumulation cliff",
            Event("Normal", Reason.PREFLIGHT_PASSED, message or "GPU preflight: FP8 accumulation is safe on this pool"),
        )
    if result.verdict == GateVerdict.UNSAFE:
        return Judgement(
            Then.ROLLBACK,
            ConditionStatus.FALSE,
            Reason.ACCUMULATION_UNSAFE,
            message,
            decision=Decided(DecisionReason.GPU_PREFLIGHT_UNSAFE, message),
        )
    # Could-not-run is not evidence either way: the accuracy gate still guards, so proceed with a warning.
    return Judgement(
        Then.ADVANCE,
        ConditionStatus.UNKNOWN,
        result.reason,
        message,
        Event("Warning", result.reason, f"{message}; relying on the accuracy gate"),
    )


# --------------------------------------------------------------------------------------------------------- accuracy

_ACCURACY_VERDICTS = (GateVerdict.PASS, GateVerdict.FAIL, GateVerdict.INCONCLUSIVE)


def _accuracy_job(inputs: JobInputs) -> b.GateJob:
    return _tool_job(inputs, b.accuracy_command, inputs.spec.gates.accuracy.timeout_seconds)


def _accuracy_record(spec: KVPolicySpec, view: JobView, report: GateReport) -> GateResult:
    if not _readable(report, _ACCURACY_VERDICTS):
        return GateResult(
            verdict=GateVerdict.ERROR,
            reason=DecisionReason.ACCURACY_GATE_ERROR,
            message=f"the accuracy gate Job {view.name} failed without a verdict ({_no_verdict(view, report)})",
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
    if result.verdict == GateVerdict.PASS and result.profile is not None and result.profile.systematic_shift:
        return _shift_judgement(spec, result, text)
    if result.verdict == GateVerdict.PASS:
        event = Event("Normal", Reason.ACCURACY_GATE_PASSED, text)
        return Judgement(Then.ADVANCE, ConditionStatus.TRUE, Reason.RECOVERY_ABOVE_MINIMUM, text, event)
    if result.verdict == GateVerdict.FAIL:
        return Judgement(
            Then.ROLLBACK,
            ConditionStatus.FALSE,
            Reason.RECOVERY_BELOW_MINIMUM,
            text,
            Event("Warning", Reason.ACCURACY_GATE_FAILED, text),
            Decided(DecisionReason.ACCURACY_RECOVERY_BELOW_MINIMUM, text),
        )
    if result.verdict == GateVerdict.INCONCLUSIVE:
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


# ----------------------------------------------------------------------------------------------------- latency probe

_PROBE_VERDICTS = (GateVerdict.PASS, GateVerdict.BREACH, GateVerdict.INCONCLUSIVE)


def _probe_job(inputs: JobInputs) -> b.GateJob:
    return _tool_job(inputs, b.latency_command, inputs.spec.gates.latency.inconclusive_deadline_seconds)


def _probe_record(spec: KVPolicySpec, view: JobView, report: GateReport) -> GateResult:
    if _readable(report, _PROBE_VERDICTS):
        return GateResult(verdict=report.verdict, reason=report.reason, message=report.message)
    return GateResult(
        verdict=GateVerdict.ERROR,
        reason=report.reason,
        message=f"latency probe Job {view.name} ended without a verdict ({_no_verdict(view, report)})",
    )


def _probe_timed_out(spec: KVPolicySpec) -> GateResult:
    return GateResult(
        verdict=GateVerdict.INCONCLUSIVE,
        reason=DecisionReason.LATENCY_PROBE_TIMEOUT,
        message="the latency probe did not finish",
    )


def _probe_judge(spec: KVPolicySpec, result: GateResult) -> Judgement:
    message = result.message
    if result.verdict == GateVerdict.PASS:
        return Judgement(Then.ADVANCE, ConditionStatus.TRUE, Reason.PROBE_WITHIN_THRESHOLDS, message)
    if result.verdict == GateVerdict.BREACH:
        return Judgement(Then.ROLLBACK, ConditionStatus.FALSE, DecisionReason.LATENCY_BREACH, message)
    timed_out = result.reason == DecisionReason.LATENCY_PROBE_TIMEOUT
    reason = DecisionReason.LATENCY_PROBE_TIMEOUT if timed_out else DecisionReason.LATENCY_INCONCLUSIVE
    return Judgement(Then.INCONCLUSIVE, ConditionStatus.UNKNOWN, reason, message)


def _set_preflight(status: KVPolicyStatus, result: GateResult | None) -> None:
    status.preflight = result


def _set_accuracy(status: KVPolicyStatus, result: GateResult | None) -> None:
    status.accuracy = result


def _set_probe(status: KVPolicyStatus, result: GateResult | None) -> None:
    if status.latency is not None:
        status.latency.probe = result


# ------------------------------------------------------------------------------------------------------------ table

GPU_PREFLIGHT = JobGate(
    name="preflight",
    phase=Phase.GPU_PREFLIGHT,
    condition=ConditionType.PREFLIGHT_PASSED,
    runs=lambda spec, plan: GATE_PREFLIGHT in plan.gates,
    build=_preflight_job,
    deadline_seconds=lambda spec: spec.rollout.progress_deadline_seconds,
    record=_preflight_record,
    timed_out=_preflight_timed_out,
    judge=_preflight_judge,
    result=lambda status: status.preflight,
    set_result=_set_preflight,
    skip=_preflight_not_probed,
)

ACCURACY = JobGate(
    name="accuracy",
    phase=Phase.ACCURACY_GATE,
    condition=ConditionType.ACCURACY_GATE_PASSED,
    runs=lambda spec, plan: GATE_ACCURACY in plan.gates,
    build=_accuracy_job,
    deadline_seconds=lambda spec: spec.gates.accuracy.timeout_seconds,
    record=_accuracy_record,
    timed_out=_accuracy_timed_out,
    judge=_accuracy_judge,
    result=lambda status: status.accuracy,
    set_result=_set_accuracy,
    min_recovery=lambda spec: float(spec.gates.accuracy.min_recovery),
)

# Synthetic traffic: the latency probe Job judges the canary inside the LatencyAnalysis phase.
LATENCY_PROBE = JobGate(
    name="latency",
    phase=Phase.LATENCY_ANALYSIS,
    condition=ConditionType.LATENCY_GATE_PASSED,
    runs=lambda spec, plan: GATE_LATENCY in plan.gates,
    build=_probe_job,
    deadline_seconds=lambda spec: spec.gates.latency.inconclusive_deadline_seconds,
    record=_probe_record,
    timed_out=_probe_timed_out,
    judge=_probe_judge,
    result=lambda status: status.latency.probe if status.latency else None,
    set_result=_set_probe,
)

# The gates with a phase of their own, in the order they run (between CanaryStarting and LatencyAnalysis).
PHASE_GATES: tuple[JobGate, ...] = (GPU_PREFLIGHT, ACCURACY)
JOB_GATES: tuple[JobGate, ...] = (*PHASE_GATES, LATENCY_PROBE)
GATE_OF_PHASE = {gate.phase: gate for gate in PHASE_GATES}


def finished_gates(before: KVPolicyStatus, after: KVPolicyStatus) -> list[tuple[JobGate, GateResult]]:
    """The gates whose result turned from absent or Running into a verdict between two statuses, each once: what
    the gate-results metric counts."""
    finished = []
    for gate in JOB_GATES:
        old, new = gate.result(before), gate.result(after)
        running = GateVerdict.RUNNING
        if new is not None and new.verdict != running and (old is None or old.verdict == running):
            finished.append((gate, new))
    return finished
