"""The canary's share of the users' requests: meant, and measured from the servers' own counters.

Each live analysis check reads, for both sides, the requests they finished in its window (vllm:request_success_total,
either spelling, through the metrics provider). Their ratio is the share the canary really got, against the share it
was meant to get: a step's weight (traffic InferencePool) or its pods' share of all the pods (ReplicaRatio, which an
endpoint picker in front of the pods makes false). A share far from the intent is said by its own condition and a
Warning, not judged as latency: the latency verdicts stay the analysis' (which never passes a canary with no requests,
minRequests being at least 1).
"""

from __future__ import annotations

import math

from kvpolicy.analysis.model import Verdict
from kvpolicy.api.reasons import Reason
from kvpolicy.api.v1alpha1 import ConditionStatus, ConditionType, Traffic, TrafficShare
from kvpolicy.rollout.step_types import timestamp
from kvpolicy.rollout.tick import Tick

CONDITION = ConditionType.TRAFFIC_SHARE_AS_INTENDED
# Fewer requests than this in a window tell no share (at 10 %, 20 requests put the canary's count at 2 +- 1.3).
MIN_REQUESTS = 20
# A share this many percentage points from the intent is skewed, however many requests show it...
MIN_TOLERANCE_POINTS = 10.0
# ... and, with few requests, only beyond this many standard deviations of a binomial share at the intent.
TOLERANCE_SIGMAS = 3.0
# No canary request at all is a skew once the intent makes this many expected (a chance of e^-5, 0.7 %, by luck).
EXPECTED_FOR_NO_TRAFFIC = 5.0


def intended_percent(t: Tick) -> float | None:
    """The share the canary is meant to get now; None where it gets no users (Synthetic)."""
    traffic = t.spec.rollout.traffic
    routed, spec = t.status.traffic, t.spec.rollout.inference_pool
    if traffic == Traffic.INFERENCE_POOL and routed is not None and routed.mirroring and spec is not None:
        mirrored = float(spec.mirror_percent or 0)  # copies of that share of the requests, beside all of them
        return 100.0 * mirrored / (100.0 + mirrored)
    if traffic == Traffic.INFERENCE_POOL:
        return float(routed.weight) if routed is not None else None
    group = t.status.routing_group
    if traffic == Traffic.REPLICA_RATIO and group is not None and group.confirmed_at is not None:
        return float(group.share_percent)  # a routing group's weights, not the replicas, set the share
    if traffic == Traffic.REPLICA_RATIO and t.obs.target is not None:
        canary = t.spec.rollout.canary_replicas
        target = int(t.obs.target["spec"].get("replicas", 1))
        return 100.0 * canary / (canary + target)
    return None


def tolerance_points(intended: float, requests: float) -> float:
    p = intended / 100.0
    return max(MIN_TOLERANCE_POINTS, 100.0 * TOLERANCE_SIGMAS * math.sqrt(p * (1.0 - p) / max(requests, 1.0)))


def judge(intended: float, canary: float, baseline: float) -> tuple[ConditionStatus, Reason, str]:
    """Whether a measured split of requests is the intended share (pure)."""
    total = canary + baseline
    if canary == 0 and baseline * intended / 100.0 >= EXPECTED_FOR_NO_TRAFFIC:
        message = f"the canary served no request while the baseline served {baseline:.0f} (intended {intended:.0f} %)"
        return ConditionStatus.FALSE, Reason.NO_CANARY_TRAFFIC, message
    if total < MIN_REQUESTS or canary == 0:  # none yet, with too few expected to call it skewed: never "as intended"
        return ConditionStatus.UNKNOWN, Reason.TOO_FEW_REQUESTS, f"{total:.0f} requests in the window tell no share"
    measured = 100.0 * canary / total
    tolerance = tolerance_points(intended, total)
    said = f"the canary served {measured:.1f} % of {total:.0f} requests, intended {intended:.0f} % (+- {tolerance:.0f})"
    if abs(measured - intended) > tolerance:
        return ConditionStatus.FALSE, Reason.TRAFFIC_SHARE_SKEWED, said
    return ConditionStatus.TRUE, Reason.SHARE_AS_INTENDED, said


def record(t: Tick, verdict: Verdict) -> None:
    """Keep the share this analysis check measured, and say when it is far from the intent."""
    intended = intended_percent(t)
    canary = verdict.canary.finished_requests if verdict.canary else None
    baseline = verdict.baseline.finished_requests if verdict.baseline else None
    if intended is None or canary is None or baseline is None or verdict.canary is None:
        return
    total = canary + baseline
    t.status.traffic_share = TrafficShare(
        intended_percent=round(intended, 2),
        measured_percent=round(100.0 * canary / total, 2) if total > 0 else None,
        canary_requests=round(canary, 3),
        baseline_requests=round(baseline, 3),
        window_seconds=round(verdict.canary.window_seconds, 3),
        at=timestamp(t.now),
    )
    status, reason, message = judge(intended, canary, baseline)
    if t.condition(CONDITION, status, reason, message) and status == ConditionStatus.FALSE:
        t.event("Warning", reason, message)
