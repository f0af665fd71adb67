"""The rollout state machine: one pure `step(policy, observations, config) -> StepResult` per KVPolicy.

All progress lives in the status the step returns; the observations say what the cluster looks like now. Every action
is idempotent (deterministic names, create-if-absent, patches computed from what is observed), so replaying a step
after a crash or an operator restart repeats nothing harmful and loses nothing.

Phases: Planning -> HeldBF16 | CanaryStarting -> [GpuPreflight] -> [AccuracyGate] -> LatencyAnalysis
-> [AwaitingApproval] -> Promoting -> Promoted, and from anywhere before the promotion: RollingBack -> RolledBack.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Literal

from kvpolicy.analysis import (
    Action as AnalysisAction,
)
from kvpolicy.analysis import (
    AnalysisState,
    LatencyGateConfig,
    Verdict,
    VerdictKind,
    next_analysis_state,
    parse_ratio,
)
from kvpolicy.analysis import (
    OnInconclusive as AnalysisOnInconclusive,
)
from kvpolicy.api.v1alpha1 import (
    Approval,
    CanaryRef,
    Condition,
    Decision,
    GateResult,
    KVPolicy,
    KVPolicySpec,
    LatencyAnalysis,
    LatencyCheck,
    OnInconclusive,
    Plan,
    PodTemplateRecord,
    Traffic,
    parse_decimal,
)
from kvpolicy.controller import builders as b
from kvpolicy.controller.state import (
    CANARY_PHASES,
    TERMINAL_PHASES,
    Action,
    Create,
    Delete,
    Event,
    JobView,
    Kind,
    Obj,
    Observations,
    Patch,
    Phase,
    StepConfig,
    StepResult,
    parse_timestamp,
    timestamp,
)
from kvpolicy.planner import GATE_ACCURACY, GATE_LATENCY, GATE_PREFLIGHT, plan

# Spec fields that steer a running rollout rather than define it: changing them must not restart the analysis.
CONTROL_FIELDS = ("paused", "abort", "approval", "approved")
HISTORY_LIMIT = 10
# Planner reason codes that make a plan BF16, most specific first; the first present names the decision.
BF16_CAUSES = (
    "UnknownGPU",
    "NoTwoLevelImage",
    "MLARequiresCalibratedScales",
    "NoFP8TensorCores",
    "HeadDim256PrefillPenalty",
    "BelowDecodeBreakEven",
    "BF16Requested",
    "FP8Refused",
)

# Condition types.
PLANNED = "Planned"
CANARY_READY = "CanaryReady"
CAPACITY_AVAILABLE = "CapacityAvailable"
PREFLIGHT_PASSED = "PreflightPassed"
ACCURACY_GATE_PASSED = "AccuracyGatePassed"
LATENCY_GATE_PASSED = "LatencyGatePassed"
PROMOTED = "Promoted"
ROLLED_BACK = "RolledBack"
PAUSED = "Paused"

ConditionStatus = Literal["True", "False", "Unknown"]


def rollout_hash(spec: KVPolicySpec) -> str:
    """A digest of everything in the spec that defines the rollout (the control fields left out)."""
    data = spec.to_k8s()
    rollout = data.get("rollout", {})
    for name in CONTROL_FIELDS:
        rollout.pop(name, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def latency_gate_config(spec: KVPolicySpec) -> LatencyGateConfig:
    latency = spec.gates.latency
    return LatencyGateConfig(
        ttft_max_ratio=parse_ratio(latency.ttft_max_ratio, "gates.latency.ttftMaxRatio"),
        itl_max_ratio=parse_ratio(latency.itl_max_ratio, "gates.latency.itlMaxRatio"),
        quantiles=tuple(parse_decimal(q) for q in latency.quantiles),
        window_seconds=latency.window_seconds,
        min_requests=max(1, latency.min_requests),
        interval_seconds=latency.interval_seconds,
        consecutive_failure_limit=latency.consecutive_failure_limit,
        on_inconclusive=AnalysisOnInconclusive(latency.on_inconclusive.value),
        inconclusive_deadline_seconds=latency.inconclusive_deadline_seconds,
        bake_seconds=spec.rollout.bake_seconds,
    )


def uses_live_analysis(spec: KVPolicySpec, plan_: Plan | None) -> bool:
    """ReplicaRatio rollouts judge latency from live traffic (metrics analysis); Synthetic ones from the probe Job."""
    gated = plan_ is not None and GATE_LATENCY in plan_.gates
    return gated and spec.rollout.traffic == Traffic.REPLICA_RATIO


def latency_check_due(policy: KVPolicy, now: datetime) -> bool:
    """Whether observe should run a metrics check for this step (pure, shared by observe and the tests)."""
    status = policy.status
    if status.phase != Phase.LATENCY_ANALYSIS or not uses_live_analysis(policy.spec, status.plan):
        return False
    if status.latency is None or status.latency.started_at is None:
        return False
    last = parse_timestamp(status.latency.last.at) if status.latency.last else None
    return last is None or now >= last + timedelta(seconds=policy.spec.gates.latency.interval_seconds)


def phase_deadline(policy: KVPolicy) -> datetime | None:
    """When the current phase must be over (the RolloutStuck alert fires past it); None for phases that may hold."""
    status, spec = policy.status, policy.spec
    entered = parse_timestamp(status.phase_entered_at)
    if entered is None or not status.phase or any(c.type == PAUSED and c.status == "True" for c in status.conditions):
        return None
    phase = Phase(status.phase)
    seconds: float
    if phase == Phase.ACCURACY_GATE:
        seconds = spec.gates.accuracy.timeout_seconds
    elif phase == Phase.LATENCY_ANALYSIS:
        latency = spec.gates.latency
        seconds = spec.rollout.progress_deadline_seconds + spec.rollout.bake_seconds
        seconds += latency.inconclusive_deadline_seconds if latency.enabled else 0
    elif phase in (Phase.CANARY_STARTING, Phase.GPU_PREFLIGHT, Phase.PROMOTING, Phase.ROLLING_BACK):
        seconds = spec.rollout.progress_deadline_seconds
    else:
        return None
    return entered + timedelta(seconds=seconds)


def parse_gate_output(job: JobView) -> dict[str, object] | None:
    """The JSON verdict a gate wrote to its termination log (with FallbackToLogsOnError, the last JSON line)."""
    if not job.termination_message:
        return None
    for line in reversed(job.termination_message.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "verdict" in value:
            return value
    try:
        whole = json.loads(job.termination_message)
    except ValueError:
        return None
    return whole if isinstance(whole, dict) and "verdict" in whole else None


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _camel_reason(value: object, fallback: str) -> str:
    text = str(value) if value else ""
    return text if text[:1].isalpha() and text.replace("_", "").isalnum() else fallback


class _Tick:
    """The working state of one step: a copy of the status, and the actions and events it accumulates."""

    def __init__(self, policy: KVPolicy, obs: Observations, config: StepConfig) -> None:
        self.spec = policy.spec
        self.obs = obs
        self.now = obs.now
        self.config = config
        self.status = policy.status.model_copy(deep=True)
        metadata = policy.metadata
        self.generation = int(metadata.get("generation") or 1)
        self.ref = b.PolicyRef(
            name=str(metadata.get("name", "")),
            namespace=str(metadata.get("namespace", "")),
            uid=str(metadata.get("uid", "")),
        )
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.requeue = config.poll_seconds

    # -------------------------------------------------------------------------------------------- bookkeeping

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))
        self.status.message = message

    def condition(self, type_: str, status: ConditionStatus, reason: str, message: str = "") -> bool:
        """Set a condition; True when its status changed (a transition worth an event)."""
        conditions = self.status.conditions
        for index, existing in enumerate(conditions):
            if existing.type == type_:
                changed = existing.status != status
                conditions[index] = Condition(
                    type=type_,
                    status=status,
                    reason=reason,
                    message=message,
                    last_transition_time=timestamp(self.now) if changed else existing.last_transition_time,
                    observed_generation=self.generation,
                )
                return changed
        conditions.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=timestamp(self.now),
                observed_generation=self.generation,
            )
        )
        return True

    def condition_is(self, type_: str, status: ConditionStatus) -> bool:
        return any(c.type == type_ and c.status == status for c in self.status.conditions)

    def enter(self, phase: Phase) -> None:
        self.status.phase = phase.value
        self.status.phase_entered_at = timestamp(self.now)

    @property
    def phase(self) -> Phase:
        return Phase(self.status.phase) if self.status.phase else Phase.PLANNING

    def phase_age(self) -> float:
        entered = parse_timestamp(self.status.phase_entered_at) or self.now
        return (self.now - entered).total_seconds()

    def decide(self, result: str, reason: str, message: str) -> None:
        decision = Decision(
            result=result,
            reason=reason,
            message=message,
            generation=self.generation,
            kv_cache_dtype="FP8" if result == PROMOTED else "BF16",
            time=timestamp(self.now),
        )
        self.status.decision = decision
        self.status.history = [*self.status.history, decision][-HISTORY_LIMIT:]

    def add(self, action: Action) -> None:
        self.actions.append(action)

    # ----------------------------------------------------------------------------------------------- lookups

    @property
    def plan(self) -> Plan:
        if self.status.plan is None:  # pragma: no cover - every phase after Planning records the plan
            raise RuntimeError(f"phase {self.phase} without a plan in status")
        return self.status.plan

    @property
    def canary(self) -> CanaryRef:
        if self.status.canary is None:  # pragma: no cover - every canary phase records the canary
            raise RuntimeError(f"phase {self.phase} without a canary in status")
        return self.status.canary

    def baseline_service_name(self) -> str:
        return b.child_name(self.ref.name, f"baseline-g{self.canary.generation}")

    def job(self, gate: str) -> str:
        return b.job_name(self.ref.name, gate, self.canary.generation)

    def serving_port(self) -> int:
        assert self.obs.target is not None
        return b.serving_port(b.vllm_container(self.obs.target, self.spec.target_ref.container))

    def url(self, service: str) -> str:
        return b.service_url(service, self.ref.namespace, self.serving_port())

    @property
    def observed_canary(self) -> Obj | None:
        """The observed canary Deployment, if it is this rollout's."""
        canary = self.obs.canary
        if canary is None or canary["metadata"]["name"] != self.canary.deployment:
            return None
        return canary

    def ready_canary_pods(self, joined: bool) -> int:
        target_labels = b.template_labels(self.obs.target) if joined and self.obs.target else {}
        return sum(
            1
            for pod in self.obs.canary_pods
            if pod.ready
            and pod.labels.get(b.CANARY_LABEL) == self.canary.deployment
            and all(pod.labels.get(k) == v for k, v in target_labels.items())
        )

    def result(self) -> StepResult:
        # Conditions that survived this step hold for the generation it looked at (a spec change that would void
        # them restarts the rollout and clears them).
        for condition in self.status.conditions:
            condition.observed_generation = self.generation
        return StepResult(self.status, tuple(self.actions), tuple(self.events), max(0.0, self.requeue))


# ------------------------------------------------------------------------------------------------------ transitions


def _restart(t: _Tick, spec_hash: str, why: str) -> None:
    """A new rollout: clean up the previous one's children and plan again. History and the recorded template stay,
    so a later rollback still restores the configuration from before any promotion."""
    previous = t.status
    if previous.canary is not None and t.phase not in TERMINAL_PHASES:
        t.add(Delete(Kind.DEPLOYMENT, previous.canary.deployment))
        t.add(Delete(Kind.SERVICE, previous.canary.service))
        t.add(Delete(Kind.SERVICE, b.child_name(t.ref.name, f"baseline-g{previous.canary.generation}")))
        for gate in (previous.preflight, previous.accuracy, previous.latency.probe if previous.latency else None):
            if gate is not None and gate.job and gate.verdict == "Running":
                t.add(Delete(Kind.JOB, gate.job))
    if previous.spec_hash is not None:
        reason = "AnalysisRestarted" if t.phase not in TERMINAL_PHASES else "RolloutRestarted"
        t.event("Normal", reason, why)
    t.status = previous.model_copy(
        update={
            "plan": None,
            "gpu": None,
            "canary": None,
            "preflight": None,
            "accuracy": None,
            "latency": None,
            "decision": None,
            "conditions": [],
            "spec_hash": spec_hash,
            "rollout_generation": t.generation,
            "rollout_started_at": timestamp(t.now),
        }
    )
    t.status.message = why
    t.enter(Phase.PLANNING)


def _rollback(t: _Tick, reason: str, message: str) -> None:
    t.decide(ROLLED_BACK, reason, message)
    t.condition(ROLLED_BACK, "False", reason, f"rolling back: {message}")
    t.event("Warning", "RollingBack", f"{reason}: {message}")
    t.enter(Phase.ROLLING_BACK)
    # The rollback itself starts with the next pass, which observes everything it must remove.
    t.requeue = 0


def _gate_sequence(p: Plan) -> list[Phase]:
    sequence = [Phase.CANARY_STARTING]
    if GATE_PREFLIGHT in p.gates:
        sequence.append(Phase.GPU_PREFLIGHT)
    if GATE_ACCURACY in p.gates:
        sequence.append(Phase.ACCURACY_GATE)
    sequence.append(Phase.LATENCY_ANALYSIS)
    return sequence


def _advance(t: _Tick) -> None:
    """Enter the phase after the current one. Its work starts with the next pass, on observations made for it."""
    sequence = _gate_sequence(t.plan)
    position = sequence.index(t.phase) if t.phase in sequence else len(sequence) - 1
    if position + 1 < len(sequence):
        following = sequence[position + 1]
        t.enter(following)
        if following == Phase.GPU_PREFLIGHT:
            t.status.preflight = GateResult(verdict="Running", job=t.job("preflight"))
        elif following == Phase.ACCURACY_GATE:
            t.status.accuracy = GateResult(verdict="Running", job=t.job("accuracy"))
        else:
            t.status.latency = LatencyAnalysis()
        t.requeue = 0
        return
    if t.spec.rollout.approval == Approval.MANUAL and not t.spec.rollout.approved:
        t.enter(Phase.AWAITING_APPROVAL)
        t.event("Normal", "AwaitingApproval", "all gates passed; set spec.rollout.approved to true to promote")
        t.requeue = t.config.idle_seconds
        return
    _start_promotion(t)


def _start_promotion(t: _Tick) -> None:
    t.enter(Phase.PROMOTING)
    t.event("Normal", "Promoting", f"gates passed: promoting {t.spec.target_ref.name} to FP8 KV")
    t.requeue = 0


# ------------------------------------------------------------------------------------------------------------ phases


def _bf16_cause(p: Plan) -> tuple[str, str]:
    by_code = {reason.code: reason.message for reason in p.reasons}
    for code in BF16_CAUSES:
        if code in by_code:
            return code, by_code[code]
    last = p.reasons[-1] if p.reasons else None
    return (last.code, last.message) if last else ("HoldBF16", "the plan keeps BF16")


def _planning(t: _Tick) -> None:
    target = t.obs.target
    if target is None:
        message = f"target Deployment {t.spec.target_ref.name} not found"
        if t.condition(PLANNED, "False", "TargetNotFound", message):
            t.event("Warning", "TargetNotFound", message)
        return
    try:
        b.container_index(target, t.spec.target_ref.container)
    except b.TargetShapeError as error:
        if t.condition(PLANNED, "False", "InvalidTarget", str(error)):
            t.event("Warning", "InvalidTarget", str(error))
        return
    if t.obs.gpu is None:  # pragma: no cover - observe always reports GPU facts while planning
        return
    planned = plan(t.spec, t.obs.gpu)
    t.status.plan = planned
    t.status.gpu = t.obs.gpu
    if not planned.is_fp8:
        code, message = _bf16_cause(planned)
        t.condition(PLANNED, "True", "BF16Planned", message)
        t.decide("HeldBF16", code, message)
        t.enter(Phase.HELD_BF16)
        t.event("Normal", "HeldBF16", f"{code}: {message}")
        _held_bf16(t)
        return
    summary = f"FP8 KV ({' '.join(planned.extra_args)}) on {t.obs.gpu.product or t.obs.gpu.generation.value}"
    if planned.image:
        summary += f" with image {planned.image}"
    summary += f"; gates: {', '.join(planned.gates) or 'none'}"
    t.condition(PLANNED, "True", "FP8Planned", summary)
    name = b.canary_name(t.ref.name, t.generation)
    t.status.canary = CanaryRef(deployment=name, service=name, generation=t.generation)
    t.event("Normal", "Planned", summary)
    t.enter(Phase.CANARY_STARTING)
    _canary_starting(t)


def _ensure_canary_objects(t: _Tick) -> None:
    target = t.obs.target
    assert target is not None
    name = t.canary.deployment
    port = t.serving_port()
    if t.observed_canary is None:
        t.add(Create(Kind.DEPLOYMENT, b.canary_deployment(t.ref, name, target, t.spec, t.plan)))
    if t.canary.service not in t.obs.services:
        t.add(Create(Kind.SERVICE, b.canary_service(t.ref, t.canary.service, port)))
    baseline = t.baseline_service_name()
    if baseline not in t.obs.services:
        service = b.baseline_service(t.ref, target, port)
        service["metadata"]["name"] = baseline
        t.add(Create(Kind.SERVICE, service))


def _watch_capacity(t: _Tick) -> bool:
    """Report pods the scheduler cannot place; True while some are unschedulable."""
    unschedulable = [pod for pod in t.obs.canary_pods if pod.unschedulable]
    if unschedulable:
        message = f"canary pod {unschedulable[0].name} cannot be scheduled: {unschedulable[0].unschedulable}"
        if t.condition(CAPACITY_AVAILABLE, "False", "Unschedulable", message):
            t.event("Warning", "CanaryUnschedulable", message)
        return True
    return False


def _deadline_rollback(t: _Tick, unschedulable: bool, waiting_for: str) -> bool:
    deadline = t.spec.rollout.progress_deadline_seconds
    if t.phase_age() <= deadline:
        return False
    if unschedulable:
        reason = "CapacityUnavailable"
        message = f"{waiting_for} not ready within {deadline} s: no GPU capacity for its pods"
    else:
        reason = "ProgressDeadlineExceeded"
        message = f"{waiting_for} not ready within {deadline} s"
    t.condition(CANARY_READY, "False", reason, message)
    _rollback(t, reason, message)
    return True


def _canary_starting(t: _Tick) -> None:
    unschedulable = _watch_capacity(t)
    replicas = t.spec.rollout.canary_replicas
    if t.observed_canary is not None and t.ready_canary_pods(joined=False) >= replicas:
        _ensure_canary_objects(t)
        t.condition(CAPACITY_AVAILABLE, "True", "Scheduled", "the canary's pods are scheduled")
        t.condition(CANARY_READY, "True", "CanaryReady", f"{replicas} canary pod(s) ready")
        t.event("Normal", "CanaryReady", f"canary {t.canary.deployment} ready ({replicas} pod(s)); no user traffic")
        _advance(t)
        return
    if _deadline_rollback(t, unschedulable, f"canary {t.canary.deployment}"):
        return
    _ensure_canary_objects(t)
    t.condition(CANARY_READY, "False", "CanaryStarting", f"waiting for {replicas} canary pod(s) to be ready")


def _gate_running(t: _Tick, body_job: b.GateJob) -> JobView | None:
    """The gate's Job if it has finished; create it when it is missing."""
    view = t.obs.jobs.get(body_job.name)
    if view is None:
        t.add(Create(Kind.JOB, b.gate_job(t.ref, body_job)))
        return None
    return view if view.finished else None


def _preflight_job(t: _Tick) -> b.GateJob:
    assert t.obs.target is not None
    return b.GateJob(
        name=t.job("preflight"),
        role=b.ROLE_PREFLIGHT,
        image=t.spec.gates.gpu_preflight.image or t.config.probe_image,
        command=b.preflight_command(t.spec),
        timeout_seconds=t.spec.rollout.progress_deadline_seconds,
        resources=b.PREFLIGHT_RESOURCES,
        pod_placement=b.pod_placement(t.obs.target),
    )


def _gpu_preflight(t: _Tick) -> None:
    job = _preflight_job(t)
    view = _gate_running(t, job)
    if view is None:
        if t.phase_age() > t.spec.rollout.progress_deadline_seconds:
            t.add(Delete(Kind.JOB, job.name))
            _preflight_inconclusive(t, "PreflightTimedOut", "the probe did not finish (no free GPU in the pool?)")
        return
    output = parse_gate_output(view)
    verdict = str(output.get("verdict")) if output else None
    message = str(output.get("message", "")) if output else ""
    if verdict == "Safe":
        t.status.preflight = GateResult(verdict="Safe", reason="AccumulationSafe", message=message, job=job.name)
        t.condition(PREFLIGHT_PASSED, "True", "AccumulationSafe", message or "the probe found no accumulation cliff")
        t.event("Normal", "PreflightPassed", message or "GPU preflight: FP8 accumulation is safe on this pool")
        _advance(t)
    elif verdict == "Unsafe":
        text = message or f"the probe found FP8 accumulation losing accuracy by {b.accuracy_length(t.spec)} tokens"
        t.status.preflight = GateResult(verdict="Unsafe", reason="AccumulationUnsafe", message=text, job=job.name)
        t.condition(PREFLIGHT_PASSED, "False", "AccumulationUnsafe", text)
        _rollback(t, "GpuPreflightUnsafe", text)
    else:
        detail = f"exit code {view.exit_code}" if view.exit_code is not None else (view.failure_reason or "no verdict")
        _preflight_inconclusive(t, "PreflightInconclusive", f"the probe could not run ({detail})")


def _preflight_inconclusive(t: _Tick, reason: str, message: str) -> None:
    """Could-not-run is not evidence either way: the accuracy gate still guards, so proceed with a warning."""
    job = t.job("preflight")
    t.status.preflight = GateResult(verdict="Inconclusive", reason=reason, message=message, job=job)
    t.condition(PREFLIGHT_PASSED, "Unknown", reason, message)
    t.event("Warning", reason, f"{message}; relying on the accuracy gate")
    _advance(t)


def _gate_tool_job(
    t: _Tick, gate: str, command: Callable[[KVPolicySpec, str, str], list[str]], timeout_seconds: int
) -> b.GateJob:
    """A Job running one of the operator image's gate tools against the canary and baseline Services."""
    return b.GateJob(
        name=t.job(gate),
        role=b.ROLE_GATE,
        image=t.config.gate_image,
        command=command(t.spec, t.url(t.canary.service), t.url(t.baseline_service_name())),
        timeout_seconds=timeout_seconds,
        resources=b.GATE_RESOURCES,
        pod_placement={},
    )


def _accuracy_result(view: JobView, output: dict[str, object] | None) -> GateResult:
    if output is None:
        return GateResult(verdict="Error", reason="AccuracyGateError", job=view.name)
    return GateResult(
        verdict=str(output.get("verdict")),
        reason=_camel_reason(output.get("reason"), "AccuracyGate"),
        message=str(output.get("message", "")),
        job=view.name,
        length_tokens=_int(output.get("lengthTokens")),
        samples=_int(output.get("samples")),
        canary_score=_float(output.get("canaryScore")),
        baseline_score=_float(output.get("baselineScore")),
        recovery=_float(output.get("recovery")),
        recovery_low=_float(output.get("recoveryLow")),
        recovery_high=_float(output.get("recoveryHigh")),
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


def _accuracy_gate(t: _Tick) -> None:
    job = _gate_tool_job(t, "accuracy", b.accuracy_command, t.spec.gates.accuracy.timeout_seconds)
    view = _gate_running(t, job)
    timeout = t.spec.gates.accuracy.timeout_seconds
    if view is None:
        if t.phase_age() > timeout:
            t.add(Delete(Kind.JOB, job.name))
            t.status.accuracy = GateResult(verdict="Error", reason="AccuracyGateTimeout", job=job.name)
            t.condition(ACCURACY_GATE_PASSED, "False", "AccuracyGateTimeout", f"no verdict within {timeout} s")
            _rollback(t, "AccuracyGateTimeout", f"the accuracy gate gave no verdict within {timeout} s")
        return
    result = _accuracy_result(view, parse_gate_output(view))
    result.finished_at = timestamp(t.now)
    t.status.accuracy = result
    text = _recovery_text(result, t.spec.gates.accuracy.min_recovery)
    if result.verdict == "Pass":
        t.condition(ACCURACY_GATE_PASSED, "True", "RecoveryAboveMinimum", text)
        t.event("Normal", "AccuracyGatePassed", text)
        _advance(t)
    elif result.verdict == "Fail":
        t.condition(ACCURACY_GATE_PASSED, "False", "RecoveryBelowMinimum", text)
        t.event("Warning", "AccuracyGateFailed", text)
        _rollback(t, "AccuracyRecoveryBelowMinimum", text)
    elif result.verdict == "Inconclusive":
        t.condition(ACCURACY_GATE_PASSED, "Unknown", "AccuracyInconclusive", text)
        t.event("Warning", "AccuracyGateInconclusive", text)
        _rollback(t, "AccuracyInconclusive", f"the accuracy gate could not vouch for FP8: {text}")
    else:
        detail = view.failure_reason or (f"exit code {view.exit_code}" if view.exit_code is not None else "unknown")
        message = f"the accuracy gate Job {view.name} failed without a verdict ({detail})"
        t.condition(ACCURACY_GATE_PASSED, "False", "AccuracyGateError", message)
        _rollback(t, "AccuracyGateError", message)


def _latency_passed(t: _Tick, reason: str, message: str) -> None:
    """The latency evidence is good: promote once the bake window has passed."""
    latency = t.status.latency
    assert latency is not None and latency.started_at is not None
    started = parse_timestamp(latency.started_at) or t.now
    remaining = t.spec.rollout.bake_seconds - (t.now - started).total_seconds()
    if remaining > 0:
        t.condition(LATENCY_GATE_PASSED, "Unknown", "Baking", f"{message}; {remaining:.0f} s of bake left")
        t.requeue = min(t.requeue, remaining)
        return
    t.condition(LATENCY_GATE_PASSED, "True", reason, message)
    t.event("Normal", "LatencyGatePassed", message)
    _advance(t)


def _latency_inconclusive(t: _Tick, reason: str, message: str) -> None:
    if t.spec.gates.latency.on_inconclusive == OnInconclusive.ROLLBACK:
        t.condition(LATENCY_GATE_PASSED, "False", reason, message)
        _rollback(t, reason, message)
        return
    if t.condition(LATENCY_GATE_PASSED, "Unknown", reason, f"holding (onInconclusive Hold): {message}"):
        t.event("Warning", "LatencyInconclusive", f"holding (onInconclusive Hold): {message}")
    t.requeue = t.config.idle_seconds


def _synthetic_latency(t: _Tick) -> None:
    latency = t.status.latency
    assert latency is not None
    job = _gate_tool_job(t, "latency", b.latency_command, t.spec.gates.latency.inconclusive_deadline_seconds)
    if latency.probe is None or latency.probe.verdict == "Running":
        latency.probe = GateResult(verdict="Running", job=job.name)
        view = _gate_running(t, job)
        if view is None:
            if t.phase_age() > t.spec.gates.latency.inconclusive_deadline_seconds:
                t.add(Delete(Kind.JOB, job.name))
                latency.probe = GateResult(verdict="Inconclusive", reason="LatencyProbeTimeout", job=job.name)
                _latency_inconclusive(t, "LatencyProbeTimeout", "the latency probe did not finish")
            return
        output = parse_gate_output(view) or {}
        latency.probe = GateResult(
            verdict=str(output.get("verdict", "Error")),
            reason=_camel_reason(output.get("reason"), "LatencyProbe"),
            message=str(output.get("message", "")) or f"latency probe Job {view.name} ended without a verdict",
            job=view.name,
            finished_at=timestamp(t.now),
        )
    probe = latency.probe
    if probe.verdict == "Pass":
        _latency_passed(t, "ProbeWithinThresholds", probe.message)
    elif probe.verdict == "Breach":
        t.condition(LATENCY_GATE_PASSED, "False", "LatencyBreach", probe.message)
        _rollback(t, "LatencyBreach", probe.message)
    else:
        _latency_inconclusive(t, "LatencyInconclusive", probe.message)


def _analysis_state(latency: LatencyAnalysis) -> AnalysisState:
    last = latency.last
    return AnalysisState.from_dict(
        {
            "startedAt": latency.started_at,
            "checks": latency.checks,
            "passes": latency.passes,
            "breaches": latency.breaches,
            "inconclusive": latency.inconclusive,
            "consecutiveBreaches": latency.consecutive_failures,
            "inconclusiveSince": latency.inconclusive_since,
            "lastCheckAt": last.at if last else None,
            "lastVerdict": last.verdict if last else None,
            "lastReason": last.reason if last else None,
        }
    )


def _record_check(latency: LatencyAnalysis, state: AnalysisState, verdict: Verdict, now: datetime) -> None:
    latency.checks = state.checks
    latency.passes = state.passes
    latency.breaches = state.breaches
    latency.inconclusive = state.inconclusive
    latency.consecutive_failures = state.consecutive_breaches
    latency.inconclusive_since = timestamp(state.inconclusive_since) if state.inconclusive_since else None
    latency.last = LatencyCheck(
        verdict=verdict.kind.value,
        reason=verdict.reason,
        message=verdict.message,
        # What the gate compared: resolved quantiles, and means where both sides' quantiles shared a bucket.
        ratios={c.key: round(c.ratio, 4) for c in (*(q for q in verdict.checks if q.resolved), *verdict.mean_checks)},
        canary_requests=int(verdict.canary.requests) if verdict.canary else None,
        baseline_requests=int(verdict.baseline.requests) if verdict.baseline else None,
        at=timestamp(now),
    )


def _live_latency(t: _Tick) -> None:
    latency = t.status.latency
    assert latency is not None
    config = latency_gate_config(t.spec)
    verdict = t.obs.latency_verdict
    if verdict is not None:
        state, outcome = next_analysis_state(config, _analysis_state(latency), verdict, t.now)
        _record_check(latency, state, verdict, t.now)
        if verdict.kind == VerdictKind.BREACH and outcome.action != AnalysisAction.ROLLBACK:
            t.event("Warning", "LatencyBreach", outcome.message)
        if outcome.action == AnalysisAction.PROMOTE:
            t.condition(LATENCY_GATE_PASSED, "True", outcome.reason, outcome.message)
            t.event("Normal", "LatencyGatePassed", outcome.message)
            _advance(t)
            return
        if outcome.action == AnalysisAction.ROLLBACK:
            t.condition(LATENCY_GATE_PASSED, "False", outcome.reason, outcome.message)
            _rollback(t, outcome.reason, outcome.message)
            return
        if outcome.action == AnalysisAction.HOLD:
            if t.condition(LATENCY_GATE_PASSED, "Unknown", outcome.reason, outcome.message):
                t.event("Warning", "LatencyInconclusive", outcome.message)
        else:
            t.condition(LATENCY_GATE_PASSED, "Unknown", outcome.reason, outcome.message)
        t.status.message = outcome.message
    last = parse_timestamp(latency.last.at) if latency.last else None
    due = (last + timedelta(seconds=config.interval_seconds) - t.now).total_seconds() if last else 0.0
    # A check that was due but not made (no analyser) must not spin: look again after the usual poll.
    t.requeue = due if due > 0 else t.config.poll_seconds


def _latency_analysis(t: _Tick) -> None:
    target = t.obs.target
    latency = t.status.latency
    assert target is not None and latency is not None
    joining = t.spec.rollout.traffic == Traffic.REPLICA_RATIO
    if latency.started_at is None:
        canary = t.observed_canary
        if joining and canary is not None and not b.is_joined(canary, target):
            t.add(Patch(Kind.DEPLOYMENT, t.canary.deployment, b.join_patch(t.ref, t.canary.deployment, target)))
            t.status.message = f"canary {t.canary.deployment} joining the Service(s) of {t.spec.target_ref.name}"
            return
        if canary is None or t.ready_canary_pods(joined=joining) < t.spec.rollout.canary_replicas:
            _deadline_rollback(t, _watch_capacity(t), f"canary {t.canary.deployment} (joining traffic)")
            return
        latency.started_at = timestamp(t.now)
        if joining:
            t.event("Normal", "TrafficJoined", f"canary {t.canary.deployment} now serves a share of the users' traffic")
        else:
            t.event("Normal", "LatencyAnalysisStarted", "synthetic traffic only: the latency probe drives the canary")
    if GATE_LATENCY not in t.plan.gates:
        _latency_passed(t, "LatencyGateDisabled", "gates.latency is disabled")
    elif joining:
        _live_latency(t)
    else:
        _synthetic_latency(t)


def _awaiting_approval(t: _Tick) -> None:
    if t.spec.rollout.approval == Approval.MANUAL and not t.spec.rollout.approved:
        t.status.message = "all gates passed; waiting for spec.rollout.approved"
        t.requeue = t.config.idle_seconds
        return
    t.event("Normal", "Approved", "spec.rollout.approved is set")
    _start_promotion(t)


def _current(t: _Tick) -> PodTemplateRecord | None:
    if t.obs.target is None:
        return None
    return b.container_record(b.vllm_container(t.obs.target, t.spec.target_ref.container))


def _converge_target(t: _Tick, desired: PodTemplateRecord) -> bool:
    """Patch the target's container to `desired`; True when it already is."""
    current = _current(t)
    if current is None or current == desired:
        return True
    assert t.obs.target is not None
    patch = b.container_patch(t.obs.target, t.spec.target_ref.container, desired)
    t.add(Patch(Kind.DEPLOYMENT, t.spec.target_ref.name, patch, patch_type="json"))
    return False


def _remove_children(t: _Tick) -> bool:
    """Delete the canary, its Services and any gate Job still running; True when nothing is left."""
    gone = True
    if t.obs.canary is not None:
        t.add(Delete(Kind.DEPLOYMENT, t.obs.canary["metadata"]["name"]))
        gone = False
    for service in sorted(t.obs.services):
        t.add(Delete(Kind.SERVICE, service))
        gone = False
    for job in sorted(t.obs.jobs.values(), key=lambda view: view.name):
        if not job.finished:
            t.add(Delete(Kind.JOB, job.name))
    return gone


def _promoting(t: _Tick) -> None:
    current = _current(t)
    assert current is not None
    if t.status.previous_template is None:
        # Recorded (and persisted with this step's status) before the target is touched in the next step. A target
        # someone had already set to FP8 by hand is recorded without those flags: a rollback must land on BF16.
        t.status.previous_template = b.without_fp8(current) if b.runs_fp8(current) else current
        t.status.message = f"recorded the configuration of {t.spec.target_ref.name} for a later rollback"
        t.requeue = 0
        return
    desired = b.with_plan(current, t.plan)
    patched = _converge_target(t, desired)
    removed = _remove_children(t)
    if patched and removed:
        message = f"{t.spec.target_ref.name} runs FP8 KV ({' '.join(desired.args or desired.command or [])})"
        t.decide(PROMOTED, "GatesPassed", message)
        t.condition(PROMOTED, "True", "GatesPassed", message)
        t.enter(Phase.PROMOTED)
        t.event("Normal", "Promoted", message)
        t.requeue = t.config.idle_seconds


def _bf16_configuration(t: _Tick, current: PodTemplateRecord) -> PodTemplateRecord:
    if t.status.previous_template is not None:
        return t.status.previous_template
    return b.without_fp8(current) if b.runs_fp8(current) else current


def _rolling_back(t: _Tick) -> None:
    current = _current(t)
    restored = current is None or _converge_target(t, _bf16_configuration(t, current))
    removed = _remove_children(t)
    if restored and removed:
        decision = t.status.decision
        reason = decision.reason if decision else "RolledBack"
        message = decision.message if decision else ""
        if current is not None:
            how = "restored" if t.status.previous_template is not None else "runs"
            message = f"{message}; {t.spec.target_ref.name} {how} its BF16 configuration"
        t.status.previous_template = None
        t.condition(ROLLED_BACK, "True", reason, message)
        t.enter(Phase.ROLLED_BACK)
        t.event("Warning", "RolledBack", message)
        t.requeue = t.config.idle_seconds


def _held_bf16(t: _Tick) -> None:
    current = _current(t)
    if current is not None and _converge_target(t, _bf16_configuration(t, current)):
        t.status.previous_template = None
    t.requeue = t.config.idle_seconds if not t.actions else t.config.poll_seconds


_PHASES = {
    Phase.PLANNING: _planning,
    Phase.HELD_BF16: _held_bf16,
    Phase.CANARY_STARTING: _canary_starting,
    Phase.GPU_PREFLIGHT: _gpu_preflight,
    Phase.ACCURACY_GATE: _accuracy_gate,
    Phase.LATENCY_ANALYSIS: _latency_analysis,
    Phase.AWAITING_APPROVAL: _awaiting_approval,
    Phase.PROMOTING: _promoting,
    Phase.ROLLING_BACK: _rolling_back,
}


def step(policy: KVPolicy, obs: Observations, config: StepConfig) -> StepResult:
    """Advance one KVPolicy by one step: the new status, the API writes and events, and when to look again."""
    t = _Tick(policy, obs, config)
    spec_hash = rollout_hash(t.spec)
    decision = t.status.decision
    t.status.observed_generation = t.generation
    # A restart plans on fresh observations: these were made for the previous rollout's children.
    if t.status.spec_hash is None:
        _restart(t, spec_hash, "planning")
    elif t.status.spec_hash != spec_hash:
        _restart(t, spec_hash, f"spec changed (generation {t.generation}): planning the rollout again")
        t.requeue = 0
        return t.result()
    if t.phase == Phase.ROLLED_BACK and decision and decision.reason == "Aborted" and not t.spec.rollout.abort:
        _restart(t, spec_hash, "spec.rollout.abort was cleared: starting the rollout again")
        t.requeue = 0
        return t.result()
    phase = t.phase

    if phase in CANARY_PHASES | {Phase.PROMOTING} and obs.target is None:
        _rollback(t, "TargetNotFound", f"target Deployment {t.spec.target_ref.name} disappeared")
        return t.result()
    if t.spec.rollout.abort and phase not in (Phase.ROLLED_BACK, Phase.HELD_BF16, Phase.ROLLING_BACK):
        _rollback(t, "Aborted", "spec.rollout.abort is set")
        return t.result()
    if t.spec.rollout.paused and phase in CANARY_PHASES | {Phase.PLANNING}:
        if t.condition(PAUSED, "True", "Paused", "spec.rollout.paused holds the rollout"):
            t.event("Normal", "RolloutPaused", f"holding in phase {phase.value} (spec.rollout.paused)")
        t.requeue = config.idle_seconds
        return t.result()
    if t.condition_is(PAUSED, "True"):
        t.condition(PAUSED, "False", "Resumed", "spec.rollout.paused was cleared")
        t.event("Normal", "RolloutResumed", f"resuming phase {phase.value}; its deadline starts again")
        t.status.phase_entered_at = timestamp(t.now)

    handler = _PHASES.get(phase)
    if handler is None:
        t.requeue = config.idle_seconds
    else:
        handler(t)
    return t.result()
