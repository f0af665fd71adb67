"""The rollout state machine: one pure `step(policy, observations, config) -> StepResult` per KVPolicy.

All progress lives in the status the step returns; the observations say what the cluster looks like now. Every action
is idempotent (deterministic names, create-if-absent, patches computed from what is observed), so replaying a step
after a crash or an operator restart repeats nothing harmful and loses nothing.

The phases (`Phase` in the API) are handled here, except the Job gates' (gate_phase.py, one table entry each in
gates/) and LatencyAnalysis (latency_phase.py); `Tick` and the transitions are in tick.py, the spec-derived rules
in rules.py. Metrics checks (metric_checks.py) are reacted to by their stage: VERIFY ones here, before any gate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from kvpolicy.analysis.checks import Stage, Verification
from kvpolicy.analysis.model import Verdict
from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import (
    AnalysisPhase,
    CanaryRef,
    ConditionStatus,
    ConditionType,
    DecisionResult,
    Difference,
    Drift,
    KVPolicy,
    OnDrift,
    Parallelism,
    Phase,
    PodTemplateRecord,
    Traffic,
)
from kvpolicy.planning.gpu import planning_change
from kvpolicy.planning.planner import bf16_cause, plan
from kvpolicy.rollout import builders as b
from kvpolicy.rollout import drift, traffic_router
from kvpolicy.rollout.gate_phase import job_gate_phase
from kvpolicy.rollout.gates import PHASE_GATES
from kvpolicy.rollout.gates.job import JobGate
from kvpolicy.rollout.latency_phase import background_analysis, keep_joined, latency_analysis
from kvpolicy.rollout.rules import rollout_hash, stale_evidence, uses_live_analysis
from kvpolicy.rollout.step_types import (
    Create,
    Delete,
    Kind,
    Obj,
    Observations,
    Patch,
    StepConfig,
    StepResult,
    timestamp,
)
from kvpolicy.rollout.tick import (
    CANARY_PHASES,
    REPLAN_PHASES,
    Tick,
    advance,
    approved,
    deadline_rollback,
    restart,
    rollback,
    rollout_id,
    start_promotion,
    watch_capacity,
)


def _planning(t: Tick) -> None:
    target = t.obs.target
    if target is None:
        message = f"target {t.spec.target_ref.kind.value} {t.spec.target_ref.name} not found"
        if t.condition(ConditionType.PLANNED, ConditionStatus.FALSE, Reason.TARGET_NOT_FOUND, message):
            t.event("Warning", Reason.TARGET_NOT_FOUND, message)
        return
    try:
        base = t.target_kind.record(target, t.spec.target_ref.container)
    except b.TargetShapeError as error:
        if t.condition(ConditionType.PLANNED, ConditionStatus.FALSE, Reason.INVALID_TARGET, str(error)):
            t.event("Warning", Reason.INVALID_TARGET, str(error))
        return
    if t.obs.gpu is None:  # pragma: no cover - observe always reports GPU facts while planning
        return
    planned = plan(t.spec, t.obs.gpu)
    t.status.plan = planned
    t.status.gpu = t.obs.gpu
    # What this rollout is gated on: promotion applies the plan to it, and only while the target still matches it.
    t.status.target_base = base
    if not planned.is_fp8:
        cause = bf16_cause(planned)
        t.condition(ConditionType.PLANNED, ConditionStatus.TRUE, Reason.BF16_PLANNED, cause.message)
        t.enter(Phase.HELD_BF16)
        t.decide(DecisionResult.HELD_BF16, cause.code, cause.message)
        t.event("Normal", Reason.HELD_BF16, f"{cause.code}: {cause.message}")
        _apply_bf16_decision(t)
        return
    summary = f"FP8 KV ({' '.join(planned.extra_args)}) on {t.obs.gpu.product or t.obs.gpu.generation.value}"
    if planned.image:
        summary += f" with image {planned.image}"
    summary += f"; gates: {', '.join(planned.gates) or 'none'}"
    image_change = _image_change(t, planned.image, target)
    if image_change is not None:
        t.event("Warning", Reason.CANARY_IMAGE_DIFFERS, image_change)
    sizes = t.target_kind.parallelism(target, t.spec.target_ref.container)
    if sizes != Parallelism():
        summary += f"; the canary keeps the target's parallel sizes ({sizes.describe()})"
    t.condition(ConditionType.PLANNED, ConditionStatus.TRUE, Reason.FP8_PLANNED, summary)
    traffic_router.check_replica_ratio(t)
    run = t.status.rollout_run or 1
    name = b.canary_name(t.ref.name, t.generation, run)
    t.status.canary = CanaryRef(deployment=name, service=name, generation=t.generation, run=run, parallelism=sizes)
    t.event("Normal", Reason.PLANNED, summary)
    t.enter(Phase.CANARY_STARTING)
    _canary_starting(t)


def _image_change(t: Tick, image: str | None, target: Mapping[str, Any]) -> str | None:
    """What a plan's own image (images.fp8Patched on a truncating GPU) changes besides the KV cache, or None."""
    current = t.target_kind.container(target, t.spec.target_ref.container).get("image")
    if image is None or image == current:
        return None
    return (
        f"the canary runs {image}, the target {current}: the gates judge that image change as well as FP8 KV, and "
        "promotion moves the target to it; build images.fp8Patched on the target's vLLM release"
    )


def _ensure_canary_objects(t: Tick) -> None:
    target = t.obs.target
    assert target is not None
    name = t.canary.deployment
    port = t.serving_port()
    if t.observed_canary is None:
        t.add(Create(t.target_kind.object_kind, t.target_kind.canary(t.ref, name, target, t.spec, t.plan)))
    if t.canary.service not in t.obs.services:
        serving = t.target_kind.serving_labels(target)
        t.add(Create(Kind.SERVICE, b.canary_service(t.ref, t.canary.service, port, serving)))
    baseline = t.baseline_service_name()
    if baseline not in t.obs.services:
        selector = t.target_kind.serving_selector(target)
        t.add(Create(Kind.SERVICE, b.baseline_service(t.ref, selector, port, baseline)))


def _canary_starting(t: Tick) -> None:
    unschedulable = watch_capacity(t)
    replicas = t.spec.rollout.canary_replicas
    if t.observed_canary is not None and not _same_parallelism(t, t.observed_canary):
        return
    if t.observed_canary is not None and t.ready_canary_pods(joined=False) >= replicas:
        _ensure_canary_objects(t)
        if not _verified(t) or not _target_settled(t):
            return
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


def _target_settled(t: Tick) -> bool:
    """The gates compare the canary with the target's pods: a target still rolling out (the restart after the last
    promotion, a user's edit) has none ready or a mix of two configurations, so the gates wait for it, within the
    progress deadline."""
    target = t.obs.target
    if target is None or t.target_kind.rolled_out(target):
        return True
    name = t.spec.target_ref.name
    if not deadline_rollback(t, None, f"target {name} (rolling out, so no baseline to gate against)"):
        t.status.message = f"canary ready; waiting for {name} to finish rolling out: the gates compare with its pods"
        t.requeue = min(t.requeue, t.config.poll_seconds)
    return False


def _same_parallelism(t: Tick, canary: Obj) -> bool:
    """Part of the canary configuration check, before any gate: the canary must split the model as the target did
    when it was planned (vllm:cache_config_info does not say; accuracy depended on the tensor-parallel size at long
    context, vllm #23813). A mismatch rolls back."""
    expected = t.canary.parallelism
    try:
        found = t.target_kind.parallelism(canary, t.spec.target_ref.container)
    except b.TargetShapeError as error:
        rollback(t, DecisionReason.CANARY_CONFIG_MISMATCH, f"canary {t.canary.deployment}: {error}")
        return False
    if expected is None or found == expected:
        return True
    message = (
        f"the canary {t.canary.deployment} runs parallel sizes {found.describe()}, the target {expected.describe()}: "
        "the gates would not compare the KV cache alone"
    )
    t.condition(
        ConditionType.CANARY_CONFIG_VERIFIED, ConditionStatus.FALSE, DecisionReason.CANARY_CONFIG_MISMATCH, message
    )
    rollback(t, DecisionReason.CANARY_CONFIG_MISMATCH, message)
    return False


def _verified(t: Tick) -> bool:
    """The ready canary's VERIFY checks (metric_checks.py), before any gate: True once every check read this pass has
    passed (or passed before). Not read (no metrics provider configured for the step): not checked."""
    for result in t.obs.verdicts(Stage.VERIFY):
        verification = result.check.verification
        if verification is None or t.condition_is(verification.condition, ConditionStatus.TRUE):
            continue
        if not _verify(t, verification, result.verdict):
            return False
    return True


def _verify(t: Tick, verification: Verification, verdict: Verdict) -> bool:
    """One VERIFY check's verdict: a pass records its evidence, a breach rolls back, and no data waits up to
    progressDeadlineSeconds."""
    condition = verification.condition
    if verdict.phase is AnalysisPhase.SUCCESSFUL:
        if verdict.evidence is not None:
            verdict.evidence.record(t.status)
        t.condition(condition, ConditionStatus.TRUE, verdict.reason, verdict.message)
        t.event("Normal", verification.passed_event, verdict.message)
        return True
    if verdict.phase is AnalysisPhase.FAILED:
        t.condition(condition, ConditionStatus.FALSE, verdict.reason, verdict.message)
        rollback(t, verdict.reason, verdict.message)
        return False
    deadline = t.spec.rollout.progress_deadline_seconds
    if t.phase_age() > deadline:
        reason = DecisionReason.PROGRESS_DEADLINE_EXCEEDED
        message = f"{verification.unverified} within {deadline} s: {verdict.message}"
        t.condition(condition, ConditionStatus.FALSE, reason, message)
        rollback(t, reason, message)
        return False
    waiting = f"{verification.waiting}: {verdict.message}"
    # What waiting will not fix (a credential the spec references that cannot be used) says so by its own reason,
    # with one Warning event when it appears.
    waiting_reason = verdict.reason if verdict.needs_attention else verification.waiting_reason
    before = t.condition_reason(condition)
    t.condition(condition, ConditionStatus.UNKNOWN, waiting_reason, waiting)
    if verdict.needs_attention and before != waiting_reason:
        t.event("Warning", waiting_reason, waiting)
    return False


def _awaiting_approval(t: Tick) -> None:
    """Hold with every gate passed until an approval names this rollout. A canary serving users keeps being analysed
    (background_analysis); an approval promotes only on fresh evidence (rules.stale_evidence); past
    rollout.approvalTimeoutSeconds the rollout rolls back."""
    t.requeue = t.config.idle_seconds
    if t.spec.rollout.traffic == Traffic.REPLICA_RATIO:
        keep_joined(t)
    if uses_live_analysis(t.spec, t.plan) and not background_analysis(t):
        return
    rollout = t.status.rollout_id
    if approved(t):
        stale = stale_evidence(t.spec, t.status, t.now)
        if stale is None:
            t.event("Normal", Reason.APPROVED, f"rollout {rollout} approved (spec.rollout.approvedRollout)")
            start_promotion(t)
            return
        waiting = f"rollout {rollout} is approved; the promotion waits for a passing latency check"
        if not (t.status.message or "").startswith(waiting):  # once per wait, not once per pass
            t.event("Normal", Reason.APPROVAL_AWAITS_ANALYSIS, f"{waiting}: {stale}")
        t.status.message = f"{waiting}: {stale}"
    timeout = t.spec.rollout.approval_timeout_seconds
    if t.phase_age() > timeout:
        message = (
            f"rollout {rollout} was not approved and promoted within {timeout} s (rollout.approvalTimeoutSeconds); "
            f"`kubectl kvpolicy retry {t.ref.name}` runs it again"
        )
        rollback(t, DecisionReason.APPROVAL_TIMED_OUT, message)
        return
    t.requeue = min(t.requeue, max(1.0, timeout - t.phase_age()))
    if approved(t):
        return
    named = t.spec.rollout.approved_rollout
    left = f"rolls back at {timestamp(t.now + timedelta(seconds=timeout - t.phase_age()))} unless approved"
    if named is not None:
        t.status.message = (
            f"all gates passed; spec.rollout.approvedRollout names rollout {named}, not this one "
            f"({rollout}): waiting for an approval of {rollout} ({left})"
        )
    else:
        t.status.message = f"all gates passed; waiting for an approval of rollout {rollout} ({left})"


def _observed(t: Tick) -> PodTemplateRecord | None:
    """The target's serving configuration now; None when the target or its vLLM container is gone."""
    if t.obs.target is None:
        return None
    try:
        return t.target_kind.record(t.obs.target, t.spec.target_ref.container)
    except b.TargetShapeError:
        return None


def _advise(t: Tick, desired: PodTemplateRecord) -> None:
    """Advisory mode: publish the change that makes the target `desired`, once per rollout and configuration."""
    assert t.obs.target is not None and t.status.rollout_id is not None
    advice = drift.advice(t.status.rollout_id, t.target_kind, t.obs.target, t.spec.target_ref.container, desired)
    if t.status.advice == advice:
        return
    t.status.advice = advice
    t.event(
        "Normal",
        Reason.ADVISED,
        f"applyMode Advisory: apply to {t.spec.target_ref.kind.value} {advice.deployment} ({advice.summary}); "
        f"{t.target_kind.advice_patch_type} patch (also in status.advice): {advice.strategic_merge_patch}",
    )


def _converge_target(t: Tick, desired: PodTemplateRecord) -> bool:
    """Patch the target's container to `desired` (Advisory: publish the change instead); True when nothing is left
    to wait for."""
    current = _observed(t)
    if current is None or current == desired:
        return True
    assert t.obs.target is not None
    if t.advisory:
        _advise(t, desired)
        return True
    patch = t.target_kind.patch(t.obs.target, t.spec.target_ref.container, desired)
    t.add(Patch(t.target_kind.object_kind, t.spec.target_ref.name, patch, patch_type="json"))
    return False


def _base(t: Tick, current: PodTemplateRecord) -> PodTemplateRecord:
    """The configuration this rollout was gated on; a rollout started by an operator that did not record it adopts
    the target as it is."""
    if t.status.target_base is None:
        t.status.target_base = current
    return t.status.target_base


def _target_changed(t: Tick, found: list[Difference], why: str) -> None:
    """The target is no longer what this rollout was gated on: say what changed and run the rollout again on it."""
    summary = drift.describe(found) or why
    message = f"target {t.spec.target_ref.name} changed during the rollout ({summary}): {why}"
    t.condition(ConditionType.DRIFTED, ConditionStatus.TRUE, Reason.TARGET_CHANGED, message)
    t.event("Warning", Reason.TARGET_CHANGED, message)
    t.notice_drift(found, message)
    restart(t, rollout_hash(t.spec), f"{message}; planning again", target_changed=True)
    t.requeue = 0


def _still_gated(t: Tick) -> bool:
    """Before the promotion: the target must still be what the canary was built from, or the analysis restarts."""
    current = _observed(t)
    if current is None:
        missing = [Difference(field="Container", expected=t.spec.target_ref.container or "first", observed="missing")]
        _target_changed(t, missing, "its vLLM container is gone")
        return False
    found = drift.differences(_base(t, current), current)
    if found:
        _target_changed(t, found, "the gates ran on another configuration")
        return False
    return True


def _remove_children(t: Tick, *, promoted: bool) -> bool:
    """Put the user's route back (traffic InferencePool), then delete the canary (after a promotion, where its kind
    keeps it as a way back, stop it instead: status.retainedCanary), its pool, its Services and any gate Job still
    running; True when nothing is left to do."""
    gone = traffic_router.release(t)
    if t.obs.canary is not None:
        name = t.obs.canary["metadata"]["name"]
        kept = t.target_kind.keep_after_promotion(t.obs.canary) if promoted else None
        for action in t.target_kind.retire(name) if kept is None else kept:
            t.add(action)
        if kept == []:
            t.status.retained_canary = name
        else:
            gone = False
    for service in sorted(t.obs.services):
        t.add(Delete(Kind.SERVICE, service))
        gone = False
    for job in sorted(t.obs.jobs.values(), key=lambda view: view.name):
        if not job.finished:
            t.add(Delete(Kind.JOB, job.name))
    return gone


def _promoting(t: Tick) -> None:
    target = t.obs.target
    current = _observed(t)
    if target is None or current is None:
        _still_gated(t)
        return
    base = _base(t, current)
    desired = t.target_kind.with_plan(base, t.plan)
    # Only the plan's change on top of what was gated: the target may be there still, or there already (our patch,
    # or a GitOps repository taking the advice); anything else was never gated.
    if drift.differences(desired, current) and not _still_gated(t):
        return
    if t.status.previous_template is None:
        # Recorded (and persisted with this step's status) before the target is touched in the next step. A target
        # someone had already set to FP8 by hand is recorded without those flags: a rollback must land on BF16.
        t.status.previous_template = b.without_fp8(current) if b.runs_fp8(current) else current
        t.status.message = f"recorded the configuration of {t.spec.target_ref.name} for a later rollback"
        t.requeue = 0
        return
    if t.advisory:
        _await_adoption(t, target, current, desired)
        return
    patched = _converge_target(t, desired)
    removed = _remove_children(t, promoted=True)
    if patched and removed:
        message = f"{t.spec.target_ref.name} runs FP8 KV ({' '.join(desired.args or desired.command or [])})"
        _promoted(t, desired, DecisionReason.GATES_PASSED, message)


def _promoted(t: Tick, desired: PodTemplateRecord, reason: str, message: str) -> None:
    t.status.target_decided = desired
    t.enter(Phase.PROMOTED)
    t.decide(DecisionResult.PROMOTED, reason, message)
    t.condition(ConditionType.PROMOTED, ConditionStatus.TRUE, reason, message)
    t.event("Normal", Reason.PROMOTED, message)
    _in_sync(t)
    t.requeue = t.config.idle_seconds


def _in_sync(t: Tick) -> None:
    """The target runs what was decided: a Drifted condition (kept through a re-evaluation) clears."""
    name = t.spec.target_ref.name
    if t.status.drift is not None or t.condition_is(ConditionType.DRIFTED, ConditionStatus.TRUE):
        t.event("Normal", Reason.IN_SYNC, f"{name} runs what was decided again")
    t.condition(ConditionType.DRIFTED, ConditionStatus.FALSE, Reason.IN_SYNC, f"{name} runs what was decided")
    t.status.drift = None


def _await_adoption(t: Tick, target: Obj, current: PodTemplateRecord, desired: PodTemplateRecord) -> None:
    """Advisory: publish the change, free the canary's GPUs, and count the rollout as promoted once the target's pods
    all run the change."""
    _advise(t, desired)
    removed = _remove_children(t, promoted=True)
    adopted = not drift.differences(desired, current)
    if adopted and t.target_kind.rolled_out(target) and removed:
        message = (
            f"{t.spec.target_ref.name}'s pods run the advised FP8 KV configuration "
            f"({' '.join(desired.args or desired.command or [])})"
        )
        _promoted(t, desired, DecisionReason.ADOPTED, message)
        return
    if adopted:
        waiting = f"the pods of {t.spec.target_ref.name} are rolling out the advised change"
    else:
        waiting = f"waiting for {t.spec.target_ref.name} to take the change in status.advice (applyMode Advisory)"
    t.condition(ConditionType.PROMOTED, ConditionStatus.FALSE, Reason.AWAITING_ADOPTION, waiting)
    t.status.message = waiting
    t.requeue = t.config.poll_seconds if adopted else t.config.idle_seconds


def _bf16_configuration(t: Tick, current: PodTemplateRecord) -> PodTemplateRecord:
    if t.status.previous_template is not None:
        return t.status.previous_template
    return b.without_fp8(current) if b.runs_fp8(current) else current


def _rolling_back(t: Tick) -> None:
    current = _observed(t)
    restored = current is None or _converge_target(t, _bf16_configuration(t, current))
    removed = _remove_children(t, promoted=False)
    if restored and removed:
        decision = t.status.decision
        reason = decision.reason if decision else Reason.ROLLED_BACK
        message = decision.message if decision else ""
        if current is not None and t.advisory and current != _bf16_configuration(t, current):
            message = f"{message}; {t.spec.target_ref.name} needs the change in status.advice to run BF16"
        elif current is not None:
            how = "restored" if t.status.previous_template is not None else "runs"
            message = f"{message}; {t.spec.target_ref.name} {how} its BF16 configuration"
        t.status.previous_template = None
        t.condition(ConditionType.ROLLED_BACK, ConditionStatus.TRUE, reason, message)
        t.enter(Phase.ROLLED_BACK)
        t.event("Warning", Reason.ROLLED_BACK, message)
        t.requeue = t.config.idle_seconds


def _apply_bf16_decision(t: Tick) -> None:
    """A BF16 decision: the target runs its configuration without FP8 KV flags (patched once, or advised)."""
    current = _observed(t)
    if current is None:
        return
    desired = _bf16_configuration(t, current)
    _converge_target(t, desired)
    t.status.target_decided = desired
    t.status.previous_template = None
    t.requeue = t.config.idle_seconds if not t.actions else t.config.poll_seconds


def _on_drift(t: Tick) -> OnDrift:
    chosen = t.spec.rollout.on_drift
    if chosen is not None:
        return chosen
    return OnDrift.REEVALUATE if t.phase == Phase.PROMOTED else OnDrift.REPORT


def _watch_drift(t: Tick) -> None:
    """Promoted and HeldBF16: the target must keep running what was decided. If it does not (a GitOps sync reverted
    it, someone edited it), say how it differs, and plan and gate again or only report, as spec.rollout.onDrift says.
    Replicas, labels and annotations are not part of what is compared."""
    t.requeue = t.config.idle_seconds
    current = _observed(t)
    if t.status.target_decided is None and current is not None:
        # Decided by an operator that did not record it: what the decision means for the target as it is.
        adopted = (
            t.target_kind.with_plan(current, t.plan) if t.phase == Phase.PROMOTED else _bf16_configuration(t, current)
        )
        t.status.target_decided = adopted
    expected = t.status.target_decided
    name = t.spec.target_ref.name
    if current is None or expected is None:
        what = f"{t.spec.target_ref.kind.value} {name}"
        found = [Difference(field="Target", expected=what, observed="not found or no vLLM container")]
    else:
        found = drift.differences(expected, current)
    if not found:
        _in_sync(t)
        return
    summary = drift.describe(found)
    changed = t.status.drift is None or t.status.drift.differences != found
    if changed:
        t.status.drift = Drift(detected_at=t.now, rollout_id=t.status.rollout_id, differences=found)
    decided = t.status.decision.result.value if t.status.decision else t.phase.value
    reevaluate = _on_drift(t) == OnDrift.REEVALUATE and not t.spec.rollout.paused and current is not None
    if reevaluate:
        message = f"{name} no longer runs what was decided ({decided}): {summary}; planning and gating again"
        t.condition(ConditionType.DRIFTED, ConditionStatus.TRUE, Reason.TARGET_DRIFTED, message)
        t.event("Warning", Reason.TARGET_DRIFTED, message)
        t.notice_drift(found, message)
        restart(t, rollout_hash(t.spec), message, target_changed=True)
        t.requeue = 0
        return
    why = "spec.rollout.paused" if t.spec.rollout.paused and current is not None else f"onDrift {_on_drift(t).value}"
    advice = "; status.advice has the change" if t.advisory and t.status.advice is not None else ""
    message = f"{name} no longer runs what was decided ({decided}): {summary}; reported only ({why}){advice}"
    t.condition(ConditionType.DRIFTED, ConditionStatus.TRUE, Reason.DRIFT_REPORTED, message)
    if changed:
        t.event("Warning", Reason.TARGET_DRIFTED, message)
        t.notice_drift(found, message)


def _gpu_change(t: Tick) -> str | None:
    """How the target pool's GPUs changed since planning, if that could change the plan (gpu.planning_change)."""
    if t.phase not in REPLAN_PHASES or t.obs.gpu is None or t.status.gpu is None:
        return None
    return planning_change(t.status.gpu, t.obs.gpu)


def _job_gate_handler(gate: JobGate) -> Callable[[Tick], None]:
    return lambda t: job_gate_phase(t, gate)


_PHASES: dict[Phase, Callable[[Tick], None]] = {
    Phase.PLANNING: _planning,
    Phase.HELD_BF16: _watch_drift,
    Phase.PROMOTED: _watch_drift,
    Phase.CANARY_STARTING: _canary_starting,
    **{gate.phase: _job_gate_handler(gate) for gate in PHASE_GATES},
    Phase.LATENCY_ANALYSIS: latency_analysis,
    Phase.AWAITING_APPROVAL: _awaiting_approval,
    Phase.PROMOTING: _promoting,
    Phase.ROLLING_BACK: _rolling_back,
}


def _governed_elsewhere(t: Tick, spec_hash: str, owner: str) -> None:
    """Another policy governs the target: write nothing to it. A rollout of this policy's own stops (its children are
    removed, the phase is Planning again) and waits for that policy to be deleted."""
    target = t.spec.target_ref.name
    kind = t.spec.target_ref.kind.value
    message = f"{kind} {target} is governed by KVPolicy {owner} (created first); waiting until it is deleted"
    if t.phase in CANARY_PHASES | {Phase.PROMOTING, Phase.ROLLING_BACK}:
        restart(t, spec_hash, message)
    if t.condition(ConditionType.READY, ConditionStatus.FALSE, Reason.CONFLICT, message):
        t.event("Warning", Reason.CONFLICT, message)
    t.status.message = message
    t.requeue = t.config.idle_seconds


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
    if t.status.rollout_id is None:  # a rollout started by an operator that did not name rollouts
        started = t.status.rollout_started_at or t.now
        t.status.rollout_id = rollout_id(t.ref.uid, t.status.rollout_generation or t.generation, spec_hash, started)
    if (
        t.phase == Phase.ROLLED_BACK
        and decision
        and decision.reason == DecisionReason.ABORTED
        and not t.spec.rollout.abort
    ):
        restart(t, spec_hash, "spec.rollout.abort was cleared: starting the rollout again")
        t.requeue = 0
        return t.result()
    if obs.governed_by is not None:
        _governed_elsewhere(t, spec_hash, obs.governed_by)
        return t.result()
    retry = t.spec.rollout.retry_rollout
    if t.phase == Phase.ROLLED_BACK and retry is not None and retry == t.status.rollout_id:
        if t.spec.rollout.abort:
            t.status.message = f"retry of rollout {retry} waits: spec.rollout.abort is set"
            t.requeue = config.idle_seconds
            return t.result()
        t.event("Normal", Reason.RETRY_REQUESTED, f"retry of rollout {retry} requested (spec.rollout.retryRollout)")
        restart(t, spec_hash, f"running rolled-back rollout {retry} again")
        t.requeue = 0
        return t.result()
    phase = t.phase

    if phase in CANARY_PHASES | {Phase.PROMOTING} and obs.target is None:
        ref = t.spec.target_ref
        rollback(t, DecisionReason.TARGET_NOT_FOUND, f"target {ref.kind.value} {ref.name} disappeared")
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
        t.status.phase_entered_at = t.now

    if phase in CANARY_PHASES and not _still_gated(t):
        return t.result()

    handler = _PHASES.get(phase)
    if handler is None:
        t.requeue = config.idle_seconds
    else:
        handler(t)
    return t.result()
