"""The LatencyAnalysis phase: join the traffic (ReplicaRatio) or shift the route to the step's weight
(InferencePool, traffic_router.py), then judge the canary's latency from live metrics checks or from the synthetic
latency probe Job, and promote after the bake (InferencePool: after the last step's)."""

from __future__ import annotations

from datetime import datetime

from kvpolicy.analysis.model import Action as AnalysisAction
from kvpolicy.analysis.model import AnalysisState, Outcome, Verdict
from kvpolicy.analysis.verdicts import next_analysis_state
from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import (
    AnalysisPhase,
    ConditionStatus,
    ConditionType,
    GateResult,
    GateVerdict,
    LatencyAnalysis,
    LatencyCheck,
    OnInconclusive,
    RoutingGroupStatus,
    RoutingGroupTraffic,
    Traffic,
)
from kvpolicy.rollout import traffic_router, traffic_share
from kvpolicy.rollout.gates.job import Then
from kvpolicy.rollout.gates.latency_probe import LATENCY_PROBE
from kvpolicy.rollout.rules import latency_gate_config, next_check_at
from kvpolicy.rollout.step_types import Obj, Patch
from kvpolicy.rollout.tick import Tick, advance, deadline_rollback, rollback, run_job, watch_capacity

GATE = ConditionType.LATENCY_GATE_PASSED


def _passed(t: Tick, reason: str, message: str) -> None:
    """The latency evidence is good: promote once the bake window has passed."""
    latency = t.status.latency
    assert latency is not None and latency.started_at is not None
    started = latency.started_at or t.now
    remaining = t.spec.rollout.bake_seconds - (t.now - started).total_seconds()
    if remaining > 0:
        t.condition(GATE, ConditionStatus.UNKNOWN, Reason.BAKING, f"{message}; {remaining:.0f} s of bake left")
        t.requeue = min(t.requeue, remaining)
        return
    t.condition(GATE, ConditionStatus.TRUE, reason, message)
    t.event("Normal", Reason.LATENCY_GATE_PASSED, message)
    _step_passed(t)


def _step_passed(t: Tick) -> None:
    """The analysis passed at this share of the traffic: the next step's share (InferencePool, a routing group), else
    promotion."""
    if not traffic_router.next_step(t) and not _next_weight_step(t):
        advance(t)


def _group_steps(t: Tick) -> list[int]:
    return sorted((t.spec.rollout.routing_group or RoutingGroupTraffic()).steps)


def _next_weight_step(t: Tick) -> bool:
    """A canary in a routing group whose step passed: on to the next step's share (True), or False after the last."""
    group = t.status.routing_group
    if group is None or group.step + 1 >= len(_group_steps(t)):
        return False
    t.status.routing_group = RoutingGroupStatus(group=group.group, step=group.step + 1)
    t.status.latency = LatencyAnalysis()
    t.requeue = 0
    return True


def _at_step_weight(t: Tick, target: Obj, canary: Obj) -> bool:
    """A target whose traffic the canary joined by weight (a KServe routing group): set the canary's weight for this
    step's share of the group's traffic; True once the target's group status lists the canary at that weight (the
    step counts only then). Kinds whose canary's share is its replicas are there at once."""
    kind, name = t.target_kind, t.canary.deployment
    steps = _group_steps(t)
    group = t.status.routing_group or RoutingGroupStatus(group="", step=0)
    share = steps[group.step]
    weight = kind.step_weight(name, target, share)
    if weight is None:
        return True
    if group.since is None:
        group = group.model_copy()
        group.since = t.now
    t.status.routing_group = group
    asked = group.since or t.now
    late = (t.now - asked).total_seconds() > t.spec.rollout.progress_deadline_seconds
    if isinstance(weight, str):
        t.status.message = weight
        if late:
            rollback(t, DecisionReason.PROGRESS_DEADLINE_EXCEEDED, f"canary {name}: {weight}")
        return False
    group.group, group.share_percent, group.weight = kind.routing_group(target) or "", share, weight
    if kind.canary_weight(canary) != weight:
        t.add(Patch(kind.object_kind, name, kind.weight_patch(weight)))
        t.status.message = f"canary {name}: weight {weight} for {share}% of the traffic (step {group.step + 1})"
        t.requeue = 0
        return False
    awaited = kind.traffic_confirmed(name, target, weight)
    if awaited is not None:
        t.status.message = awaited
        if late:
            rollback(t, DecisionReason.PROGRESS_DEADLINE_EXCEEDED, f"canary {name} ({awaited})")
        return False
    if group.confirmed_at is None:
        group.confirmed_at = t.now
        where = f"canary {name} at weight {weight}: {share}% of routing group {group.group} (step {group.step + 1} of "
        t.event("Normal", Reason.TRAFFIC_SHIFTED, f"{where}{len(steps)}), confirmed by its status")
    return True


def _inconclusive(t: Tick, reason: str, message: str) -> None:
    if t.spec.gates.latency.on_inconclusive == OnInconclusive.ROLLBACK:
        t.condition(GATE, ConditionStatus.FALSE, reason, message)
        rollback(t, reason, message)
        return
    if t.condition(GATE, ConditionStatus.UNKNOWN, reason, f"holding (onInconclusive Hold): {message}"):
        t.event("Warning", Reason.LATENCY_INCONCLUSIVE, f"holding (onInconclusive Hold): {message}")
    t.requeue = t.config.idle_seconds


def _synthetic(t: Tick) -> None:
    latency = t.status.latency
    assert latency is not None
    if latency.probe is None or latency.probe.verdict == GateVerdict.RUNNING:
        latency.probe = GateResult(verdict=GateVerdict.RUNNING, job=t.job(LATENCY_PROBE))
        result = run_job(t, LATENCY_PROBE)
        if result is None:
            return
        latency.probe = result
    judgement = LATENCY_PROBE.judge(t.spec, latency.probe)
    if judgement.then == Then.ADVANCE:
        _passed(t, judgement.reason, judgement.message)
    elif judgement.then == Then.ROLLBACK:
        t.condition(GATE, judgement.status, judgement.reason, judgement.message)
        rollback(t, judgement.decided.reason, judgement.decided.message)
    else:
        _inconclusive(t, judgement.reason, judgement.message)


def analysis_state(latency: LatencyAnalysis) -> AnalysisState:
    """The analysis as the status keeps it."""
    started = latency.started_at
    assert started is not None
    last = latency.last
    return AnalysisState(
        started_at=started,
        checks=latency.checks,
        passes=latency.passes,
        breaches=latency.breaches,
        inconclusive=latency.inconclusive,
        consecutive_breaches=latency.consecutive_failures,
        inconclusive_since=latency.inconclusive_since,
        last_check_at=last.at if last else None,
        last_verdict=last.verdict if last else None,
        last_reason=last.reason if last else None,
    )


def record_check(latency: LatencyAnalysis, state: AnalysisState, verdict: Verdict, now: datetime) -> None:
    """Keep the analysis and its latest check in the status."""
    latency.checks = state.checks
    latency.passes = state.passes
    latency.breaches = state.breaches
    latency.inconclusive = state.inconclusive
    latency.consecutive_failures = state.consecutive_breaches
    latency.inconclusive_since = state.inconclusive_since
    latency.last = LatencyCheck(
        verdict=verdict.kind,
        reason=verdict.reason,
        message=verdict.message,
        # What the gate compared: resolved quantiles, and means where both sides' quantiles shared a bucket.
        ratios={c.key: round(c.ratio, 4) for c in (*(q for q in verdict.checks if q.resolved), *verdict.mean_checks)},
        values=dict(verdict.values),
        canary_requests=int(verdict.canary.requests) if verdict.canary else None,
        baseline_requests=int(verdict.baseline.requests) if verdict.baseline else None,
        at=now,
    )


def _fold(t: Tick, verdict: Verdict) -> Outcome:
    """One check's verdict folded into the analysis the status keeps; what the analysis says to do next."""
    latency = t.status.latency
    assert latency is not None
    if verdict.needs_attention and (latency.last is None or latency.last.reason != verdict.reason):
        # Waiting will not fix it (a rejected query, an unusable credential): say so once, as it appears.
        t.event("Warning", verdict.reason, verdict.message)
    state, outcome = next_analysis_state(latency_gate_config(t.spec), analysis_state(latency), verdict, t.now)
    record_check(latency, state, verdict, t.now)
    traffic_share.record(t, verdict)
    return outcome


def _next_check_in(t: Tick) -> float:
    """Seconds until the next check is due (the first an interval after the join, as rules.latency_check_due); a
    check that was due but not made (no analyser) must not spin: look again after the usual poll."""
    due_at = next_check_at(t.status.latency, t.spec.gates.latency.interval_seconds)
    due = (due_at - t.now).total_seconds() if due_at else 0.0
    return due if due > 0 else t.config.poll_seconds


def background_analysis(t: Tick) -> bool:
    """AwaitingApproval with live traffic: the canary keeps serving its share of the users, so the analysis keeps
    checking it (Argo Rollouts' background analysis). Breaches up to consecutiveFailureLimit and a stall past the
    inconclusive deadline with onInconclusive Rollback roll back as they would during the analysis; a pass keeps the
    gate's condition True. False when it rolled back. Sets the requeue to the next check."""
    verdict = t.obs.analysis_verdict()
    if verdict is not None:
        outcome = _fold(t, verdict)
        waiting = "while awaiting approval"
        if outcome.action == AnalysisAction.ROLLBACK:
            t.condition(GATE, ConditionStatus.FALSE, outcome.reason, f"{waiting}: {outcome.message}")
            rollback(t, outcome.reason, f"{waiting}: {outcome.message}")
            return False
        if verdict.phase is AnalysisPhase.SUCCESSFUL:
            t.condition(GATE, ConditionStatus.TRUE, outcome.reason, f"{waiting}: {verdict.message}")
        else:
            if verdict.phase is AnalysisPhase.FAILED:
                t.event("Warning", Reason.LATENCY_BREACH, f"{waiting}: {outcome.message}")
            t.condition(GATE, ConditionStatus.UNKNOWN, outcome.reason, f"{waiting}: {outcome.message}")
    t.requeue = min(t.requeue, _next_check_in(t))
    return True


def _live(t: Tick) -> None:
    latency = t.status.latency
    assert latency is not None
    verdict = t.obs.analysis_verdict()
    if verdict is not None:
        outcome = _fold(t, verdict)
        if verdict.phase is AnalysisPhase.FAILED and outcome.action != AnalysisAction.ROLLBACK:
            t.event("Warning", Reason.LATENCY_BREACH, outcome.message)
        if outcome.action == AnalysisAction.PROMOTE:
            t.condition(GATE, ConditionStatus.TRUE, outcome.reason, outcome.message)
            t.event("Normal", Reason.LATENCY_GATE_PASSED, outcome.message)
            _step_passed(t)
            return
        if outcome.action == AnalysisAction.ROLLBACK:
            t.condition(GATE, ConditionStatus.FALSE, outcome.reason, outcome.message)
            rollback(t, outcome.reason, outcome.message)
            return
        if outcome.action == AnalysisAction.HOLD:
            # Once per stall: the checks that follow repeat the outcome until a conclusive one ends the stall.
            stalled_already = t.condition_reason(GATE) == outcome.reason
            t.condition(GATE, ConditionStatus.UNKNOWN, outcome.reason, outcome.message)
            if not stalled_already:
                serving = f"the canary {t.canary.deployment} keeps serving its share of the traffic"
                holding = f"holding (onInconclusive Hold), {serving}; fix the metrics or set spec.rollout.abort"
                t.event("Warning", outcome.reason, f"{outcome.message}; {holding}")
        else:
            t.condition(GATE, ConditionStatus.UNKNOWN, outcome.reason, outcome.message)
        t.status.message = outcome.message
    t.requeue = _next_check_in(t)


def keep_joined(t: Tick) -> int:
    """ReplicaRatio: the writes that make the canary serve the users' traffic, while any is needed (a Deployment's
    pod made later, after a crash, joins as it appears); how many were added."""
    canary = t.observed_canary
    if canary is None or t.obs.target is None:
        return 0
    actions = t.target_kind.join_actions(t.ref, t.canary.deployment, canary, t.obs.target, t.obs.canary_pods)
    for action in actions:
        t.add(action)
    return len(actions)


def latency_analysis(t: Tick) -> None:
    target = t.obs.target
    latency = t.status.latency
    assert target is not None and latency is not None
    joining = t.spec.rollout.traffic == Traffic.REPLICA_RATIO
    routed = t.spec.rollout.traffic == Traffic.INFERENCE_POOL
    joins = keep_joined(t) if joining else 0
    if latency.started_at is None:
        canary = t.observed_canary
        if joins:
            t.status.message = f"canary {t.canary.deployment} joining the Service(s) of {t.spec.target_ref.name}"
            return
        if canary is None or t.ready_canary_pods(joined=joining) < t.spec.rollout.canary_replicas:
            deadline_rollback(t, watch_capacity(t), f"canary {t.canary.deployment} (joining traffic)")
            return
        awaited = t.target_kind.traffic_confirmed(t.canary.deployment, target) if joining else None
        if awaited is not None:
            t.status.message = awaited
            deadline_rollback(t, None, f"canary {t.canary.deployment} ({awaited})")
            return
        if routed and not traffic_router.shifted(t):
            return
        if joining and not _at_step_weight(t, target, canary):
            return
        latency.started_at = t.now
        later_step = t.status.routing_group is not None and t.status.routing_group.step > 0
        if joining:
            if not later_step:  # a later step of a routing group: its TrafficShifted event said so
                joined = f"canary {t.canary.deployment} now serves a share of the users' traffic"
                t.event("Normal", Reason.TRAFFIC_JOINED, joined)
        elif not routed:  # a routed canary's TrafficShifted event said where the traffic goes
            t.event(
                "Normal",
                Reason.LATENCY_ANALYSIS_STARTED,
                "synthetic traffic only: the latency probe drives the canary",
            )
    if not LATENCY_PROBE.runs(t.spec, t.plan):
        _passed(t, Reason.LATENCY_GATE_DISABLED, "gates.latency is disabled")
    elif joining or routed:
        _live(t)
    else:
        _synthetic(t)
