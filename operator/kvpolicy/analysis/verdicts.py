"""Pure assessors: one check's verdict from the two sides' metrics, and the analysis' next state and outcome.

Missing data is never a pass and never a failure: it is NoData (or ProviderUnavailable), which neither extends nor
breaks a run of breaches, and only a stall deadline turns it into a Hold or a Rollback. Promotion needs a Pass.
Missing resolution is missing data too: a quantile whose two estimates fall in one histogram bucket is compared
through the means instead, and without means it is NoData.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from kvpolicy.analysis.histogram import bucket_containing
from kvpolicy.analysis.model import (
    Action,
    AnalysisState,
    LatencyGateConfig,
    MeanCheck,
    Outcome,
    RatioCheck,
    SideMetrics,
    Verdict,
    describe_unresolved,
    quantile_label,
)
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.api.v1alpha1 import AnalysisPhase, GateVerdict, OnInconclusive


def _no_data(reason: str, message: str, canary: SideMetrics, baseline: SideMetrics) -> Verdict:
    return Verdict(GateVerdict.NO_DATA, reason, message, canary=canary, baseline=baseline)


@dataclass
class _Comparisons:
    """What one check could compare, and what it could not."""

    checks: list[RatioCheck] = field(default_factory=list)
    mean_checks: list[MeanCheck] = field(default_factory=list)
    missing_quantiles: list[str] = field(default_factory=list)  # e.g. "ITL p95 (canary)"
    missing_means: list[str] = field(default_factory=list)  # why a mean was needed and which side lacks it

    @property
    def evidence(self) -> list[RatioCheck | MeanCheck]:
        """The comparisons that can decide: resolved quantiles, and the means standing in for unresolved ones."""
        return [*(check for check in self.checks if check.resolved), *self.mean_checks]


def _latency(side: SideMetrics, metric: str) -> tuple[Mapping[float, float | None], float | None, tuple[float, ...]]:
    if metric == "ttft":
        return side.ttft_seconds, side.ttft_mean_seconds, side.ttft_bucket_bounds
    return side.itl_seconds, side.itl_mean_seconds, side.itl_bucket_bounds


def _shared_bucket(
    canary_value: float, canary_bounds: tuple[float, ...], baseline_value: float, baseline_bounds: tuple[float, ...]
) -> tuple[float, float] | None:
    canary_bucket = bucket_containing(canary_bounds, canary_value)
    return canary_bucket if canary_bucket == bucket_containing(baseline_bounds, baseline_value) else None


def _compare(config: LatencyGateConfig, canary: SideMetrics, baseline: SideMetrics) -> _Comparisons:
    """Compare each configured quantile; where both sides' estimates fall in one bucket, compare the means instead."""
    result = _Comparisons()
    for metric, max_ratio in (("ttft", config.ttft_max_ratio), ("itl", config.itl_max_ratio)):
        if max_ratio is None:
            continue
        canary_quantiles, canary_mean, canary_bounds = _latency(canary, metric)
        baseline_quantiles, baseline_mean, baseline_bounds = _latency(baseline, metric)
        unresolved: list[RatioCheck] = []
        for quantile in config.quantiles:
            canary_value, baseline_value = canary_quantiles.get(quantile), baseline_quantiles.get(quantile)
            if canary_value is None or baseline_value is None or baseline_value <= 0:
                side = "canary" if canary_value is None else "baseline"
                result.missing_quantiles.append(f"{metric.upper()} {quantile_label(quantile)} ({side})")
                continue
            bucket = _shared_bucket(canary_value, canary_bounds, baseline_value, baseline_bounds)
            check = RatioCheck(metric, quantile, canary_value, baseline_value, max_ratio, bucket)
            result.checks.append(check)
            if not check.resolved:
                unresolved.append(check)
        if not unresolved:
            continue
        if canary_mean is None or baseline_mean is None or baseline_mean <= 0:
            side = "canary" if canary_mean is None else "baseline"
            note = describe_unresolved(metric, tuple(unresolved))
            result.missing_means.append(f"{note}, and the {side} has no {metric.upper()} mean")
            continue
        result.mean_checks.append(MeanCheck(metric, canary_mean, baseline_mean, max_ratio, tuple(unresolved)))
    return result


def _breach_reason(breaches: list[RatioCheck | MeanCheck], error_breach: bool) -> str:
    """The reason names what breached (reasons are matched by alerts), the message whether quantiles or means did."""
    if error_breach:
        return AnalysisReason.ERROR_RATIO_EXCEEDED
    metrics = sorted({check.metric for check in breaches})
    if metrics == ["ttft"]:
        return AnalysisReason.TTFT_RATIO_EXCEEDED
    if metrics == ["itl"]:
        return AnalysisReason.ITL_RATIO_EXCEEDED
    return AnalysisReason.LATENCY_RATIO_EXCEEDED


def assess(config: LatencyGateConfig, canary: SideMetrics, baseline: SideMetrics) -> Verdict:
    """Judge one check of the canary against the baseline over the same window."""
    sides = (
        (canary, AnalysisReason.NO_CANARY_SERIES, AnalysisReason.TOO_FEW_CANARY_REQUESTS),
        (baseline, AnalysisReason.NO_BASELINE_SERIES, AnalysisReason.TOO_FEW_BASELINE_REQUESTS),
    )
    for side, no_series, _ in sides:
        if not side.series_found:
            return _no_data(
                no_series,
                f"no vLLM latency series found for the {side.role} pods: check that Prometheus scrapes them "
                "and that the pod selector matches",
                canary,
                baseline,
            )
    for side, _, too_few in sides:
        if side.requests < config.min_requests:
            return _no_data(
                too_few,
                f"{side.role} served {side.requests:.0f} requests in the last {side.window_seconds:.0f} s, "
                f"fewer than the {config.min_requests} needed to compare latencies",
                canary,
                baseline,
            )
    compared = _compare(config, canary, baseline)
    if compared.missing_quantiles:
        return _no_data(
            AnalysisReason.MISSING_LATENCY_QUANTILE,
            f"cannot compare {', '.join(compared.missing_quantiles)}: no observations in the window",
            canary,
            baseline,
        )
    if compared.missing_means:
        return _no_data(
            AnalysisReason.MISSING_LATENCY_MEAN,
            f"{'; '.join(compared.missing_means)}: the quantiles cannot tell the sides apart and there is no mean "
            "to compare",
            canary,
            baseline,
        )
    checks, mean_checks = tuple(compared.checks), tuple(compared.mean_checks)
    breaches = [check for check in compared.evidence if check.breached]
    error_breach = (
        config.max_error_ratio is not None
        and canary.error_ratio is not None
        and canary.error_ratio > config.max_error_ratio
    )
    if breaches or error_breach:
        parts = [check.describe() for check in breaches]
        if error_breach:
            parts.insert(0, f"canary error ratio {canary.error_ratio:.3f} is above {config.max_error_ratio:.3f}")
        reason = _breach_reason(breaches, error_breach)
        return Verdict(GateVerdict.BREACH, reason, "; ".join(parts), checks, canary, baseline, mean_checks)
    evidence = compared.evidence
    worst = max(evidence, key=lambda check: check.ratio / check.max_ratio)
    # A pass decided on means says so, whichever comparison came closest.
    parts = [worst.describe(), *(check.describe() for check in mean_checks if check is not worst)]
    return Verdict(
        GateVerdict.PASS,
        AnalysisReason.WITHIN_THRESHOLDS,
        f"all {len(evidence)} comparisons within thresholds over {canary.requests:.0f} canary and "
        f"{baseline.requests:.0f} baseline requests; closest: {'; '.join(parts)}",
        checks,
        canary,
        baseline,
        mean_checks,
    )


def next_analysis_state(
    config: LatencyGateConfig, prev: AnalysisState, verdict: Verdict, now: datetime
) -> tuple[AnalysisState, Outcome]:
    """Fold one verdict into the analysis and say what to do next."""
    state = replace(
        prev, checks=prev.checks + 1, last_check_at=now, last_verdict=verdict.kind, last_reason=verdict.reason
    )
    baked_seconds = (now - prev.started_at).total_seconds()
    if verdict.phase is AnalysisPhase.SUCCESSFUL:
        state = replace(state, passes=prev.passes + 1, consecutive_breaches=0, inconclusive_since=None)
        if baked_seconds >= config.bake_seconds and state.passes >= config.required_passes:
            return state, Outcome(
                Action.PROMOTE,
                AnalysisReason.ANALYSIS_PASSED,
                f"{state.passes} passing checks over {baked_seconds:.0f} s of bake: {verdict.message}",
            )
        return state, Outcome(
            Action.CONTINUE,
            AnalysisReason.BAKING,
            f"{state.passes}/{config.required_passes} passing checks, "
            f"{max(0.0, config.bake_seconds - baked_seconds):.0f} s of bake left",
        )
    if verdict.phase is AnalysisPhase.FAILED:
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
            AnalysisReason.ANALYSIS_STALLED,
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
