"""The GPU preflight gate: a Job on one of the pool's GPUs runs kvkernels.probe, which measures whether FP8 attention
accumulation loses accuracy on this GPU at the planned backend and length (truncating accumulators: Hopper, Ada)."""

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
    Plan,
)
from kvpolicy.gate_programs.report import GateReport
from kvpolicy.planning.attention import PROBE_BACKENDS
from kvpolicy.planning.planner import GATE_PREFLIGHT
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.gates.job import Decided, JobGate, JobInputs, Judgement, Then, no_verdict, readable
from kvpolicy.rollout.step_types import Event, JobView


def command(spec: KVPolicySpec, probe_backend: str) -> list[str]:
    """The probe measures the attention the canary will run (`probe_backend`, see attention.PROBE_BACKENDS) up to
    the full context the gates vouch for: it sends no prompt, so it needs no room for an answer (hence the uncapped
    `accuracy_length`)."""
    return [
        "python",
        "-m",
        "kvkernels.probe",
        "--backend",
        probe_backend,
        "--max-len",
        str(spec.accuracy_length),
        "--head-dim",
        str(spec.model.head_dim),
        "--json",
    ]


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
        command=command(inputs.spec, backend),
        timeout_seconds=inputs.spec.rollout.progress_deadline_seconds,
        resources=b.with_one_gpu(inputs.config.preflight_resources),
        pod_placement=b.pod_placement(inputs.pod_spec),
        image_pull_secrets=b.image_pull_secrets(inputs.pod_spec),
        env=b.PREFLIGHT_ENV,
    )


def _preflight_record(spec: KVPolicySpec, view: JobView, report: GateReport) -> GateResult:
    if readable(report, (GateVerdict.SAFE,)):
        return GateResult(verdict=GateVerdict.SAFE, reason=Reason.ACCUMULATION_SAFE, message=report.message)
    if readable(report, (GateVerdict.UNSAFE,)):
        text = report.message or f"the probe found FP8 accumulation losing accuracy by {spec.accuracy_length} tokens"
        return GateResult(verdict=GateVerdict.UNSAFE, reason=Reason.ACCUMULATION_UNSAFE, message=text)
    return GateResult(
        verdict=GateVerdict.INCONCLUSIVE,
        reason=Reason.PREFLIGHT_INCONCLUSIVE,
        message=f"the probe could not run ({no_verdict(view, report)})",
    )


def _preflight_timed_out(spec: KVPolicySpec) -> GateResult:
    return GateResult(
        verdict=GateVerdict.INCONCLUSIVE,
        reason=Reason.PREFLIGHT_TIMED_OUT,
        message="the probe did not finish (no free GPU in the pool?)",
    )


def _preflight_judge(spec: KVPolicySpec, result: GateResult) -> Judgement:
    message = result.message
    if result.verdict.phase is AnalysisPhase.SUCCESSFUL:
        return Judgement(
            Then.ADVANCE,
            ConditionStatus.TRUE,
            Reason.ACCUMULATION_SAFE,
            message or "the probe found no accumulation cliff",
            Event("Normal", Reason.PREFLIGHT_PASSED, message or "GPU preflight: FP8 accumulation is safe on this pool"),
        )
    if result.verdict.phase is AnalysisPhase.FAILED:
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


def _set_result(status: KVPolicyStatus, result: GateResult | None) -> None:
    status.preflight = result


GPU_PREFLIGHT = JobGate(
    name="preflight",
    label=GATE_PREFLIGHT,
    phase=Phase.GPU_PREFLIGHT,
    condition=ConditionType.PREFLIGHT_PASSED,
    runs=lambda spec, plan: GATE_PREFLIGHT in plan.gates,
    build=_preflight_job,
    deadline_seconds=lambda spec: spec.rollout.progress_deadline_seconds,
    record=_preflight_record,
    timed_out=_preflight_timed_out,
    judge=_preflight_judge,
    result=lambda status: status.preflight,
    set_result=_set_result,
    skip=_preflight_not_probed,
)
