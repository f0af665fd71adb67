"""The rollout state machine: one pure `step(policy, observations, config) -> StepResult` per KVPolicy.

All progress lives in the status the step returns; the observations say what the cluster looks like now. Every action
is idempotent (deterministic names, create-if-absent, patches computed from what is observed), so replaying a step
after a crash or an operator restart repeats nothing harmful and loses nothing.

The phases (`Phase` in the API) are handled here, except the Job gates' (gate_phase.py, one table entry each in
jobgates.py) and LatencyAnalysis (latency_phase.py); `Tick` and the transitions are in tick.py, the spec-derived rules
in rules.py.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import (
    Approval,
    CanaryRef,
    ConditionStatus,
    ConditionType,
    DecisionResult,
    KVPolicy,
    Phase,
    PodTemplateRecord,
)
from kvpolicy.controller import builders as b
from kvpolicy.controller.gate_phase import job_gate_phase
from kvpolicy.controller.jobgates import PHASE_GATES, JobGate
from kvpolicy.controller.latency_phase import latency_analysis
from kvpolicy.controller.rules import rollout_hash
from kvpolicy.controller.state import Create, Delete, Kind, Observations, Patch, StepConfig, StepResult, timestamp
from kvpolicy.controller.tick import (
    CANARY_PHASES,
    REPLAN_PHASES,
    Tick,
    advance,
    deadline_rollback,
    restart,
    rollback,
    start_promotion,
    watch_capacity,
)
from kvpolicy.gpu import planning_change
from kvpolicy.planner import bf16_cause, plan


def _planning(t: Tick) -> None:
    target = t.obs.target
    if target is None:
        message = f"target Deployment {t.spec.target_ref.name} not found"
        if t.condition(ConditionType.PLANNED, ConditionStatus.FALSE, Reason.TARGET_NOT_FOUND, message):
            t.event("Warning", Reason.TARGET_NOT_FOUND, message)
        return
    try:
        b.container_index(target, t.spec.target_ref.container)
    except b.TargetShapeError as error:
        if t.condition(ConditionType.PLANNED, ConditionStatus.FALSE, Reason.INVALID_TARGET, str(error)):
            t.event("Warning", Reason.INVALID_TARGET, str(error))
        return
    if t.obs.gpu is None:  # pragma: no cover - observe always reports GPU facts while planning
        return
    planned = plan(t.spec, t.obs.gpu)
    t.status.plan = planned
    t.status.gpu = t.obs.gpu
    if not planned.is_fp8:
        cause = bf16_cause(planned)
        t.condition(ConditionType.PLANNED, ConditionStatus.TRUE, Reason.BF16_PLANNED, cause.message)
        t.decide(DecisionResult.HELD_BF16, cause.code, cause.message)
        t.enter(Phase.HELD_BF16)
        t.event("Normal", Reason.HELD_BF16, f"{cause.code}: {cause.message}")
        _held_bf16(t)
        return
    summary = f"FP8 KV ({' '.join(planned.extra_args)}) on {t.obs.gpu.product or t.obs.gpu.generation.value}"
    if planned.image:
        summary += f" with image {planned.image}"
    summary += f"; gates: {', '.join(planned.gates) or 'none'}"
    t.condition(ConditionType.PLANNED, ConditionStatus.TRUE, Reason.FP8_PLANNED, summary)
    name = b.canary_name(t.ref.name, t.generation)
    t.status.canary = CanaryRef(deployment=name, service=name, generation=t.generation)
    t.event("Normal", Reason.PLANNED, summary)
    t.enter(Phase.CANARY_STARTING)
    _canary_starting(t)


def _ensure_canary_objects(t: Tick) -> None:
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
        t.add(Create(Kind.SERVICE, b.baseline_service(t.ref, target, port, t.canary.generation)))


def _canary_starting(t: Tick) -> None:
    unschedulable = watch_capacity(t)
    replicas = t.spec.rollout.canary_replicas
    if t.observed_canary is not None and t.ready_canary_pods(joined=False) >= replicas:
        _ensure_canary_objects(t)
        scheduled = "the canary's pods are scheduled"
        t.condition(ConditionType.CAPACITY_AVAILABLE, ConditionStatus.TRUE, Reason.SCHEDULED, scheduled)
        ready = f"{replicas} canary pod(s) ready"
        t.condition(ConditionType.CANARY_READY, ConditionStatus.TRUE, Reason.CANARY_READY, ready)
        ready_event = f"canary {t.canary.deployment} ready ({replicas} pod(s)); no user traffic"
        t.event("Normal", Reason.CANARY_READY, ready_event)
        advance(t)
        return
    if deadline_rollback(t, unschedulable, f"canary {t.canary.deployment}"):
        return
    _ensure_canary_objects(t)
    waiting = f"waiting for {replicas} canary pod(s) to be ready"
    t.condition(ConditionType.CANARY_READY, ConditionStatus.FALSE, Reason.CANARY_STARTING, waiting)


def _awaiting_approval(t: Tick) -> None:
    if t.spec.rollout.approval == Approval.MANUAL and not t.spec.rollout.approved:
        t.status.message = "all gates passed; waiting for spec.rollout.approved"
        t.requeue = t.config.idle_seconds
        return
    t.event("Normal", Reason.APPROVED, "spec.rollout.approved is set")
    start_promotion(t)


def _current(t: Tick) -> PodTemplateRecord | None:
    if t.obs.target is None:
        return None
    return b.container_record(b.vllm_container(t.obs.target, t.spec.target_ref.container))


def _converge_target(t: Tick, desired: PodTemplateRecord) -> bool:
    """Patch the target's container to `desired`; True when it already is."""
    current = _current(t)
    if current is None or current == desired:
        return True
    assert t.obs.target is not None
    patch = b.container_patch(t.obs.target, t.spec.target_ref.container, desired)
    t.add(Patch(Kind.DEPLOYMENT, t.spec.target_ref.name, patch, patch_type="json"))
    return False


def _remove_children(t: Tick) -> bool:
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


def _promoting(t: Tick) -> None:
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
        t.decide(DecisionResult.PROMOTED, DecisionReason.GATES_PASSED, message)
        t.condition(ConditionType.PROMOTED, ConditionStatus.TRUE, DecisionReason.GATES_PASSED, message)
        t.enter(Phase.PROMOTED)
        t.event("Normal", Reason.PROMOTED, message)
        t.requeue = t.config.idle_seconds


def _bf16_configuration(t: Tick, current: PodTemplateRecord) -> PodTemplateRecord:
    if t.status.previous_template is not None:
        return t.status.previous_template
    return b.without_fp8(current) if b.runs_fp8(current) else current


def _rolling_back(t: Tick) -> None:
    current = _current(t)
    restored = current is None or _converge_target(t, _bf16_configuration(t, current))
    removed = _remove_children(t)
    if restored and removed:
        decision = t.status.decision
        reason = decision.reason if decision else Reason.ROLLED_BACK
        message = decision.message if decision else ""
        if current is not None:
            how = "restored" if t.status.previous_template is not None else "runs"
            message = f"{message}; {t.spec.target_ref.name} {how} its BF16 configuration"
        t.status.previous_template = None
        t.condition(ConditionType.ROLLED_BACK, ConditionStatus.TRUE, reason, message)
        t.enter(Phase.ROLLED_BACK)
        t.event("Warning", Reason.ROLLED_BACK, message)
        t.requeue = t.config.idle_seconds


def _held_bf16(t: Tick) -> None:
    current = _current(t)
    if current is not None and _converge_target(t, _bf16_configuration(t, current)):
        t.status.previous_template = None
    t.requeue = t.config.idle_seconds if not t.actions else t.config.poll_seconds


def _gpu_change(t: Tick) -> str | None:
    """How the target pool's GPUs changed since planning, if that could change the plan (gpu.planning_change)."""
    if t.phase not in REPLAN_PHASES or t.obs.gpu is None or t.status.gpu is None:
        return None
    return planning_change(t.status.gpu, t.obs.gpu)


def _job_gate_handler(gate: JobGate) -> Callable[[Tick], None]:
    return lambda t: job_gate_phase(t, gate)


_PHASES: dict[Phase, Callable[[Tick], None]] = {
    Phase.PLANNING: _planning,
    Phase.HELD_BF16: _held_bf16,
    Phase.CANARY_STARTING: _canary_starting,
    **{gate.phase: _job_gate_handler(gate) for gate in PHASE_GATES},
    Phase.LATENCY_ANALYSIS: latency_analysis,
    Phase.AWAITING_APPROVAL: _awaiting_approval,
    Phase.PROMOTING: _promoting,
    Phase.ROLLING_BACK: _rolling_back,
}


def step(policy: KVPolicy, obs: Observations, config: StepConfig) -> StepResult:
    """Advance one KVPolicy by one step: the new status, the API writes and events, and when to look again."""
    t = Tick(policy, obs, config)
    spec_hash = rollout_hash(t.spec)
    decision = t.status.decision
    t.status.observed_generation = t.generation
    # A restart plans on fresh observations: these were made for the previous rollout's children.
    if t.status.spec_hash is None:
        restart(t, spec_hash, "planning")
    elif t.status.spec_hash != spec_hash:
        restart(t, spec_hash, f"spec changed (generation {t.generation}): planning the rollout again")
        t.requeue = 0
        return t.result()
    if (
        t.phase == Phase.ROLLED_BACK
        and decision
        and decision.reason == DecisionReason.ABORTED
        and not t.spec.rollout.abort
    ):
        restart(t, spec_hash, "spec.rollout.abort was cleared: starting the rollout again")
        t.requeue = 0
        return t.result()
    phase = t.phase

    if phase in CANARY_PHASES | {Phase.PROMOTING} and obs.target is None:
        rollback(t, DecisionReason.TARGET_NOT_FOUND, f"target Deployment {t.spec.target_ref.name} disappeared")
        return t.result()
    if t.spec.rollout.abort and phase not in (Phase.ROLLED_BACK, Phase.HELD_BF16, Phase.ROLLING_BACK):
        rollback(t, DecisionReason.ABORTED, "spec.rollout.abort is set")
        return t.result()
    if t.spec.rollout.paused and phase in CANARY_PHASES | {Phase.PLANNING}:
        holds = "spec.rollout.paused holds the rollout"
        if t.condition(ConditionType.PAUSED, ConditionStatus.TRUE, Reason.PAUSED, holds):
            t.event("Normal", Reason.ROLLOUT_PAUSED, f"holding in phase {phase.value} (spec.rollout.paused)")
        t.requeue = config.idle_seconds
        return t.result()
    change = _gpu_change(t)
    if change is not None:
        restart(
            t, spec_hash, f"the target's GPU nodes changed: {change}; planning the rollout again", Reason.GPU_CHANGED
        )
        t.requeue = 0
        return t.result()
    if t.condition_is(ConditionType.PAUSED, ConditionStatus.TRUE):
        cleared = "spec.rollout.paused was cleared"
        t.condition(ConditionType.PAUSED, ConditionStatus.FALSE, Reason.RESUMED, cleared)
        t.event("Normal", Reason.ROLLOUT_RESUMED, f"resuming phase {phase.value}; its deadline starts again")
        t.status.phase_entered_at = timestamp(t.now)

    handler = _PHASES.get(phase)
    if handler is None:
        t.requeue = config.idle_seconds
    else:
        handler(t)
    return t.result()
