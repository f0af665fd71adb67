"""Rules derived from a KVPolicy's spec and status alone, shared by the step, observe and the reconciler: what defines a
rollout, the latency gate's settings, when a metrics check is due, and when a phase must be over."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta

from kvpolicy.analysis.model import LatencyGateConfig, parse_ratio
from kvpolicy.api.v1alpha1 import (
    AnalysisPhase,
    ApplyMode,
    ConditionType,
    KVPolicy,
    KVPolicySpec,
    KVPolicyStatus,
    LatencyAnalysis,
    Phase,
    Plan,
    Traffic,
    parse_decimal,
)
from kvpolicy.rollout.conditions import condition_holds
from kvpolicy.rollout.gates import GATE_OF_PHASE
from kvpolicy.rollout.gates.latency_probe import LATENCY_PROBE

# Spec fields that steer a running rollout, or say how its decision is applied and watched, rather than define what
# is gated: changing them must not restart the analysis (nor must notifications). A field added with a default must be
# listed here too, or every stored policy would restart when the operator is upgraded.
CONTROL_FIELDS = (
    "paused",
    "abort",
    "approval",
    "approvalTimeoutSeconds",
    "approved",
    "approvedRollout",
    "retryRollout",
    "applyMode",
    "onDrift",
)
# Phases in which the live analysis checks the canary: LatencyAnalysis, and AwaitingApproval, where a canary that joined
# the users' traffic keeps serving them (Argo Rollouts' background analysis).
ANALYSED_PHASES = frozenset({Phase.LATENCY_ANALYSIS, Phase.AWAITING_APPROVAL})
# Credentials by reference say how to reach the servers and Prometheus, not what is rolled out: fixing a wrong Secret
# name lets a waiting rollout go on instead of restarting it.
OUTSIDE_THE_ROLLOUT = ("notifications", "vllmAuth")


def rollout_hash(spec: KVPolicySpec) -> str:
    """A digest of everything in the spec that defines the rollout (the control fields left out)."""
    data = spec.to_k8s()
    rollout = data.get("rollout", {})
    for name in CONTROL_FIELDS:
        rollout.pop(name, None)
    for name in OUTSIDE_THE_ROLLOUT:
        data.pop(name, None)
    data.get("gates", {}).get("latency", {}).pop("prometheusAuth", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def is_paused(policy: KVPolicy) -> bool:
    return condition_holds(policy.status.conditions, ConditionType.PAUSED)


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
        on_inconclusive=latency.on_inconclusive,
        inconclusive_deadline_seconds=latency.inconclusive_deadline_seconds,
        bake_seconds=spec.rollout.bake_seconds,
    )


def uses_live_analysis(spec: KVPolicySpec, plan_: Plan | None) -> bool:
    """ReplicaRatio and InferencePool rollouts judge latency from live traffic (metrics analysis); Synthetic ones from
    the probe Job."""
    gated = plan_ is not None and LATENCY_PROBE.runs(spec, plan_)
    return gated and spec.rollout.traffic != Traffic.SYNTHETIC


def latency_check_due(policy: KVPolicy, now: datetime) -> bool:
    """Whether observe should run a metrics check for this step (pure, shared by observe and the tests)."""
    status = policy.status
    if status.phase not in ANALYSED_PHASES or not uses_live_analysis(policy.spec, status.plan):
        return False
    if policy.spec.rollout.paused:  # the step holds the analysis: a check would be thrown away
        return False
    due = next_check_at(status.latency, policy.spec.gates.latency.interval_seconds)
    return due is not None and now >= due


def next_check_at(latency: LatencyAnalysis | None, interval_seconds: int) -> datetime | None:
    """When the analysis' next check is due: an interval after the last one, the first an interval after the canary
    joined (at the join there is nothing of the users' to read); None before the analysis started."""
    if latency is None or latency.started_at is None:
        return None
    since = (latency.last.at if latency.last else None) or latency.started_at
    return since + timedelta(seconds=interval_seconds)


def analysis_window_seconds(policy: KVPolicy, now: datetime) -> int:
    """The window a latency analysis check reads: gates.latency.windowSeconds, cut to the whole seconds since the
    canary joined the traffic (or this step's weight took effect). Before that the canary served only the gates'
    prompts (long-context ones, slow to first token), and a warm canary's histograms still hold them."""
    window = policy.spec.gates.latency.window_seconds
    latency = policy.status.latency
    if latency is None or latency.started_at is None:
        return window
    return max(1, min(window, int((now - latency.started_at).total_seconds())))


def phase_deadline(policy: KVPolicy) -> datetime | None:
    """When the current phase must be over (the RolloutStuck alert fires past it); None for phases that may hold."""
    status, spec = policy.status, policy.spec
    entered = status.phase_entered_at
    if entered is None or status.phase is None or is_paused(policy):
        return None
    phase = status.phase
    seconds: float
    if phase in GATE_OF_PHASE:
        seconds = GATE_OF_PHASE[phase].deadline_seconds(spec)
    elif phase == Phase.LATENCY_ANALYSIS:
        latency = spec.gates.latency
        # traffic InferencePool bakes at each step's share in turn.
        routing = spec.rollout.inference_pool
        steps = len(routing.steps) + (routing.mirror_percent is not None) if routing is not None else 1
        seconds = spec.rollout.progress_deadline_seconds + spec.rollout.bake_seconds * steps
        seconds += latency.inconclusive_deadline_seconds if latency.enabled else 0
    elif phase == Phase.AWAITING_APPROVAL:
        seconds = spec.rollout.approval_timeout_seconds
    elif phase == Phase.PROMOTING and spec.rollout.apply_mode == ApplyMode.ADVISORY:
        return None  # waiting for a GitOps repository to take the change may take a review's time
    elif phase in (Phase.CANARY_STARTING, Phase.PROMOTING, Phase.ROLLING_BACK):
        seconds = spec.rollout.progress_deadline_seconds
    else:
        return None
    return entered + timedelta(seconds=seconds)


def stale_evidence(spec: KVPolicySpec, status: KVPolicyStatus, now: datetime) -> str | None:
    """Why the live analysis' evidence cannot back a promotion now, or None when it can: the latest check must be a
    pass made within two gates.latency.intervalSeconds (one missed check tolerated). Rollouts judged without live
    analysis (Synthetic traffic, latency gate off) serve no users while they wait: their evidence does not age."""
    if not uses_live_analysis(spec, status.plan):
        return None
    last = status.latency.last if status.latency is not None else None
    at = last.at if last is not None else None
    if last is None or at is None:
        return "no latency check is recorded"
    age = (now - at).total_seconds()
    if last.verdict.phase is not AnalysisPhase.SUCCESSFUL:
        return f"the latest latency check, {age:.0f} s ago, was {last.verdict.value} ({last.reason})"
    limit = 2 * spec.gates.latency.interval_seconds
    if age > limit:
        return f"the latest passing latency check is {age:.0f} s old (an approval needs one within {limit} s)"
    return None
