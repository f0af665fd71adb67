"""Pure assessors: one check's verdict from the two sides' metrics, and the analysis' next state and outcome.

Missing data is never a pass and never a failure: it is NoData (or ProviderUnavailable), which neither extends nor
breaks a run of breaches, and only a stall deadline turns it into a Hold or a Rollback. Promotion needs a Pass.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from kvpolicy.analysis.model import (
    Action,
    AnalysisState,
    LatencyGateConfig,
    OnInconclusive,
    Outcome,
    RatioCheck,
    SideMetrics,
    Verdict,
    VerdictKind,
    quantile_label,
)


def _no_data(reason: str, message: str, canary: SideMetrics, baseline: SideMetrics) -> Verdict:
    return Verdict(VerdictKind.NO_DATA, reason, message, canary=canary, baseline=baseline)


def _ratio_checks(
    config: LatencyGateConfig, canary: SideMetrics, baseline: SideMetrics
) -> tuple[list[RatioCheck], list[str]]:
    """Comparisons that could be made, and the names of those that could not (a quantile missing on a side)."""
    checks: list[RatioCheck] = []
    missing: list[str] = []
    metrics = (
        ("ttft", config.ttft_max_ratio, canary.ttft_seconds, baseline.ttft_seconds),
        ("itl", config.itl_max_ratio, canary.itl_seconds, baseline.itl_seconds),
    )
    for metric, max_ratio, canary_values, baseline_values in metrics:
        if max_ratio is None:
            continue
        for quantile in config.quantiles:
            canary_value, baseline_value = canary_values.get(quantile), baseline_values.get(quantile)
            if canary_value is None or baseline_value is None or baseline_value <= 0:
                side = "canary" if canary_value is None else "baseline"
                missing.append(f"{metric.upper()} {quantile_label(quantile)} ({side})")
                continue
            checks.append(RatioCheck(metric, quantile, canary_value, baseline_value, max_ratio))
    return checks, missing


def assess(config: LatencyGateConfig, canary: SideMetrics, baseline: SideMetrics) -> Verdict:
    """Judge one check of the canary against the baseline over the same window."""
    for side in (canary, baseline):
        if not side.series_found:
            return _no_data(
                f"No{side.role.capitalize()}Series",
                f"no vLLM latency series found for the {side.role} pods: check that Prometheus scrapes them "
                "and that the pod selector matches",
                canary,
                baseline,
            )
    for side in (canary, baseline):
        if side.requests < config.min_requests:
            return _no_data(
                f"TooFew{side.role.capitalize()}Requests",
                f"{side.role} served {side.requests:.0f} requests in the last {side.window_seconds:.0f} s, "
                f"fewer than the {config.min_requests} needed to compare latencies",
                canary,
                baseline,
            )
    checks, missing = _ratio_checks(config, canary, baseline)
    if missing:
        return _no_data(
            "MissingLatencyQuantile",
            f"cannot compare {', '.join(missing)}: no observations in the window",
            canary,
            baseline,
        )
    breaches = [check for check in checks if check.breached]
    error_breach = (
        config.max_error_ratio is not None
        and canary.error_ratio is not None
        and canary.error_ratio > config.max_error_ratio
    )
    if breaches or error_breach:
        metrics = sorted({check.metric for check in breaches})
        if error_breach:
            reason = "ErrorRatioExceeded"
        elif metrics == ["ttft"]:
            reason = "TTFTRatioExceeded"
        elif metrics == ["itl"]:
            reason = "ITLRatioExceeded"
        else:
            reason = "LatencyRatioExceeded"
        parts = [check.describe() for check in breaches]
        if error_breach:
            parts.insert(0, f"canary error ratio {canary.error_ratio:.3f} is above {config.max_error_ratio:.3f}")
        return Verdict(VerdictKind.BREACH, reason, "; ".join(parts), tuple(checks), canary, baseline)
    worst = max(checks, key=lambda check: check.ratio / check.max_ratio)
    return Verdict(
        VerdictKind.PASS,
        "WithinThresholds",
        f"all {len(checks)} comparisons within thresholds over {canary.requests:.0f} canary and "
        f"{baseline.requests:.0f} baseline requests; closest: {worst.describe()}",
        tuple(checks),
        canary,
        baseline,
    )


def next_analysis_state(
    config: LatencyGateConfig, prev: AnalysisState, verdict: Verdict, now: datetime
) -> tuple[AnalysisState, Outcome]:
    """Fold one verdict into the analysis and say what to do next."""
    state = replace(
        prev, checks=prev.checks + 1, last_check_at=now, last_verdict=verdict.kind, last_reason=verdict.reason
    )
    baked_seconds = (now - prev.started_at).total_seconds()
    if verdict.kind is VerdictKind.PASS:
        state = replace(state, passes=prev.passes + 1, consecutive_breaches=0, inconclusive_since=None)
        if baked_seconds >= config.bake_seconds and state.passes >= config.required_passes:
            return state, Outcome(
                Action.PROMOTE,
                "AnalysisPassed",
                f"{state.passes} passing checks over {baked_seconds:.0f} s of bake: {verdict.message}",
            )
        return state, Outcome(
            Action.CONTINUE,
            "Baking",
            f"{state.passes}/{config.required_passes} passing checks, "
            f"{max(0.0, config.bake_seconds - baked_seconds):.0f} s of bake left",
        )
    if verdict.kind is VerdictKind.BREACH:
        streak = prev.consecutive_breaches + 1
        state = replace(state, breaches=prev.breaches + 1, consecutive_breaches=streak, inconclusive_since=None)
        if streak >= config.consecutive_failure_limit:
            return state, Outcome(
                Action.ROLLBACK,
                verdict.reason,
                f"{streak} consecutive breaches (limit {config.consecutive_failure_limit}): {verdict.message}",
            )
        return state, Outcome(
            Action.CONTINUE,
            verdict.reason,
            f"breach {streak}/{config.consecutive_failure_limit}: {verdict.message}",
        )
    since = prev.inconclusive_since or now
    state = replace(state, inconclusive=prev.inconclusive + 1, inconclusive_since=since)
    stalled_seconds = (now - since).total_seconds()
    if stalled_seconds >= config.inconclusive_deadline_seconds:
        action = Action.ROLLBACK if config.on_inconclusive is OnInconclusive.ROLLBACK else Action.HOLD
        return state, Outcome(
            action,
            "AnalysisStalled",
            f"no conclusive check for {stalled_seconds:.0f} s (deadline {config.inconclusive_deadline_seconds:.0f} s,"
            f" onInconclusive={config.on_inconclusive.value}); last: {verdict.kind.value}/{verdict.reason}: "
            f"{verdict.message}",
        )
    return state, Outcome(
        Action.CONTINUE,
        verdict.reason,
        f"{verdict.kind.value}: {verdict.message} "
        f"({config.inconclusive_deadline_seconds - stalled_seconds:.0f} s left before onInconclusive applies)",
    )
