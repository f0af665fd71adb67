"""traffic InferencePool, the phase logic: shift the user's HTTPRoute to each step's weight, go on to the next step
after a step's analysis passed, and put the route back when the rollout ends (promotion, rollback, restart).

Where the route is, and which step it is at, lives in `status.traffic`, so an operator that restarts picks the rollout
up at the weight it had reached. applyMode Advisory publishes the forward steps' route patches (status.traffic.advice
and an event) instead of writing them; putting the route back as the user wrote it is written in both modes, since a
route left sending users to a canary that is being removed fails their requests (and, for a GitOps repository that
holds the route as written, it is the route back in sync).
"""

from __future__ import annotations

import json

from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import (
    ConditionStatus,
    ConditionType,
    EndpointPicker,
    LatencyAnalysis,
    Traffic,
    TrafficStatus,
)
from kvpolicy.rollout.step_types import Create, Kind, Obj, Patch
from kvpolicy.rollout.tick import Tick, rollback
from kvpolicy.rollout.traffic_routes import (
    RouteShapeError,
    baseline_picker,
    canary_pool,
    original_rules,
    picker_copies,
    picker_name,
    pool_selects,
    restore_actions,
    route_patch,
)

TRAFFIC = ConditionType.TRAFFIC_ROUTED
SKEW = ConditionType.REPLICA_RATIO_HOLDS


def _unusable(t: Tick, message: str) -> None:
    """The route cannot carry the canary; once progressDeadlineSeconds have passed, roll back (the route is fixed by
    someone else, or never)."""
    if t.condition(TRAFFIC, ConditionStatus.FALSE, DecisionReason.TRAFFIC_ROUTE_UNUSABLE, message):
        t.event("Warning", DecisionReason.TRAFFIC_ROUTE_UNUSABLE, message)
    if t.phase_age() > t.spec.rollout.progress_deadline_seconds:
        rollback(t, DecisionReason.TRAFFIC_ROUTE_UNUSABLE, message)
    else:
        t.status.message = message


def _picker_ready(t: Tick, traffic: TrafficStatus, baseline: Obj) -> bool:
    """endpointPicker CopyBaseline: copy the baseline pool's EPP for the canary's pool; True once the copy is ready
    (a pool whose picker is down fails its requests, FailClose being the default)."""
    name = traffic.endpoint_picker
    assert name is not None
    try:
        service, deployment = baseline_picker(baseline, t.obs.pickers)
    except RouteShapeError as error:
        _unusable(t, str(error))
        return False
    copied_deployment, copied_service = picker_copies(t.ref, name, traffic.canary_pool, service, deployment)
    observed = t.obs.pickers.get(f"Deployment/{name}")
    if observed is None:
        t.add(Create(Kind.DEPLOYMENT, copied_deployment))
    if f"Service/{name}" not in t.obs.pickers:
        t.add(Create(Kind.SERVICE, copied_service))
    if observed is not None and int((observed.get("status") or {}).get("readyReplicas") or 0) >= 1:
        return True
    waiting = f"waiting for endpoint picker {name} (a copy of {deployment['metadata']['name']}) to be ready"
    t.condition(TRAFFIC, ConditionStatus.UNKNOWN, Reason.SHIFTING_TRAFFIC, waiting)
    t.status.message = waiting
    return False


def shifted(t: Tick) -> bool:
    """Make the route send the canary this step's share (creating the canary's pool first); True once the route is
    observed there. Advisory: publish the route's patch and wait for it to be applied."""
    spec = t.spec.rollout.inference_pool
    assert spec is not None
    baseline = t.obs.pools.get(spec.pool)
    if baseline is None:
        _unusable(t, f"InferencePool {spec.pool} (rollout.inferencePool.pool) not found")
        return False
    traffic = t.status.traffic
    if traffic is not None and traffic.canary_pool != t.canary.deployment and not release(t):
        return False  # an earlier rollout's edit (a restart that could not observe the route): put it back first
    traffic = t.status.traffic
    if traffic is None or traffic.original is None:
        try:
            records = original_rules(t.obs.route, spec, t.ref.namespace)
        except RouteShapeError as error:
            _unusable(t, str(error))
            return False
        # Recorded (and persisted with this step's status) before the route is touched by the next step.
        copying = spec.endpoint_picker == EndpointPicker.COPY_BASELINE
        picker = picker_name(t.ref.name, t.canary.generation, t.canary.run) if copying else None
        t.status.traffic = TrafficStatus(
            route=spec.http_route,
            pool=spec.pool,
            canary_pool=t.canary.deployment,
            endpoint_picker=picker,
            mirroring=spec.mirror_percent is not None,
            original=records,
        )
        t.requeue = 0
        return False
    weight = 0 if traffic.mirroring else sorted(spec.steps)[traffic.step]
    traffic.weight = weight
    mirror = spec.mirror_percent if traffic.mirroring else None
    if traffic.endpoint_picker is not None and not _picker_ready(t, traffic, baseline):
        return False
    if traffic.canary_pool not in t.obs.pools:
        t.add(Create(Kind.INFERENCE_POOL, canary_pool(t.ref, traffic.canary_pool, baseline, traffic.endpoint_picker)))
    if t.obs.route is None:
        _unusable(t, f"HTTPRoute {spec.http_route} not found")
        return False
    ops = route_patch(t.obs.route, traffic.original, traffic.canary_pool, weight, mirror)
    where = (
        f"HTTPRoute {traffic.route}: {weight}% to InferencePool {traffic.canary_pool}, {100 - weight}% to {spec.pool}"
        if mirror is None
        else f"HTTPRoute {traffic.route}: {mirror}% of the requests mirrored to InferencePool {traffic.canary_pool}, "
        f"answered by {spec.pool}"
    )
    if traffic.canary_pool not in t.obs.pools or (ops and not t.advisory):
        # The pool first, then the route (a route naming a missing pool fails the requests sent to it).
        if traffic.canary_pool in t.obs.pools:
            t.add(Patch(Kind.HTTP_ROUTE, traffic.route, ops, patch_type="json"))
        t.condition(TRAFFIC, ConditionStatus.UNKNOWN, Reason.SHIFTING_TRAFFIC, f"shifting to {where}")
        t.status.message = f"shifting to {where}"
        t.requeue = 0  # observe the write at once
        return False
    if ops:  # Advisory: the forward step is the GitOps repository's to apply
        advice = json.dumps(ops, separators=(",", ":"))
        if traffic.advice != advice:
            traffic.advice = advice
            t.event(
                "Normal",
                Reason.ROUTE_CHANGE_ADVISED,
                f"applyMode Advisory: apply to {where} (also in status.traffic.advice): "
                f"kubectl patch httproute {traffic.route} --type json -p '{advice}'",
            )
        t.condition(TRAFFIC, ConditionStatus.UNKNOWN, Reason.ROUTE_CHANGE_ADVISED, f"waiting for {where}")
        t.requeue = t.config.poll_seconds
        return False
    traffic.advice = None
    traffic.shifted_at = t.now
    step = "mirror phase" if traffic.mirroring else f"step {traffic.step + 1} of {len(spec.steps)}"
    t.condition(TRAFFIC, ConditionStatus.TRUE, Reason.TRAFFIC_SHIFTED, f"{where} ({step})")
    t.event("Normal", Reason.TRAFFIC_SHIFTED, f"{where} ({step})")
    return True


def next_step(t: Tick) -> bool:
    """After a step's analysis passed: go on to the next step's weight (True), or False after the last one."""
    spec = t.spec.rollout.inference_pool
    traffic = t.status.traffic
    if spec is None or traffic is None or (not traffic.mirroring and traffic.step + 1 >= len(spec.steps)):
        return False
    if traffic.mirroring:  # the mirror phase passed: the first step's share next
        traffic.mirroring = False
    else:
        traffic.step += 1
    traffic.shifted_at = None
    t.status.latency = LatencyAnalysis()
    t.requeue = 0
    return True


def release(t: Tick) -> bool:
    """Restore the route and remove the canary's pool (promotion, rollback); True when both are done."""
    actions, done = restore_actions(t.status, t.obs)
    for action in actions:
        t.add(action)
    if done and t.status.traffic is not None:
        traffic = t.status.traffic
        restored = f"HTTPRoute {traffic.route} is as written again; InferencePool {traffic.canary_pool} removed"
        t.condition(TRAFFIC, ConditionStatus.FALSE, Reason.TRAFFIC_RESTORED, restored)
        t.event("Normal", Reason.TRAFFIC_RESTORED, restored)
        t.status.traffic = None
    return done


def check_replica_ratio(t: Tick) -> None:
    """traffic ReplicaRatio: an InferencePool selecting the target's pods means an endpoint picker, not the replica
    count, decides the canary's share once it joins; and an FP8-KV canary, with about twice the KV blocks, reports
    about half the KV-cache usage and is sent more than its share. Say so by name, once per rollout."""
    if t.spec.rollout.traffic != Traffic.REPLICA_RATIO or t.obs.target is None:
        return
    # The labels the target's serving pods carry, whatever its kind (a Deployment's template, a LeaderWorkerSet's
    # leaders, the pods KServe labels).
    target = t.obs.target
    labels = {**t.target_kind.serving_selector(target), **t.target_kind.traffic_labels(target)}
    selecting = sorted(name for name, pool in t.obs.pools.items() if pool_selects(pool, labels))
    if not selecting:
        t.condition(SKEW, ConditionStatus.TRUE, Reason.NO_INFERENCE_POOL, "no InferencePool selects the target's pods")
        return
    message = (
        f"InferencePool {', '.join(selecting)} selects the pods of {t.spec.target_ref.name}: once the canary joins, "
        "its endpoint picker, not the replica ratio, sets the canary's share, and it scores pods by KV-cache usage, "
        "which an FP8-KV canary (about twice the KV blocks) reports at about half: it will be sent more than its "
        "share of the users. Use rollout.traffic InferencePool (a pool of its own and the HTTPRoute's weights)"
    )
    if t.condition(SKEW, ConditionStatus.FALSE, Reason.INFERENCE_POOL_SELECTS_TARGET, message):
        t.event("Warning", Reason.INFERENCE_POOL_SELECTS_TARGET, message)
