"""Inputs and results of the latency analysis; the operator maps its spec into these (the verdict and onInconclusive
enums are the API's, so status and analysis share one spelling).

Everything here is plain data: frozen dataclasses with `to_dict()` so the operator can put verdicts in events and
reports. The operator keeps an `AnalysisState` in the KVPolicy status (LatencyAnalysis) to resume after a restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol

from kvpolicy.api.reasons import CREDENTIAL_PROBLEMS, AnalysisReason
from kvpolicy.api.v1alpha1 import AnalysisPhase, GateVerdict, KVPolicyStatus, OnInconclusive

DEFAULT_QUANTILES: tuple[float, ...] = (0.5, 0.95)


class Action(StrEnum):
    CONTINUE = "Continue"
    PROMOTE = "Promote"
    ROLLBACK = "Rollback"
    HOLD = "Hold"


class ProviderUnavailableError(Exception):
    """The metrics source could not answer (unreachable, 5xx, timeout, rejected query): the check is inconclusive."""

    def __init__(self, reason: AnalysisReason, message: str, needs_attention: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        # Waiting will not help (a rejected query, a credential the spec references that cannot be used): someone must
        # fix it, so it is said at once.
        self.needs_attention = needs_attention or reason in CREDENTIAL_PROBLEMS


def parse_ratio(text: str | float, field_name: str) -> float:
    """Parse a ratio threshold written as a string in the spec (the CRD has no floats), e.g. "1.2"."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f'{field_name}: {text!r} is not a number; write a ratio such as "1.2"') from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f'{field_name}: {text!r} must be a finite ratio above 0, such as "1.2"')
    return value


def quantile_label(quantile: float) -> str:
    """0.5 -> "p50", 0.95 -> "p95", 0.999 -> "p99.9"."""
    return "p" + f"{quantile * 100:.4f}".rstrip("0").rstrip(".")


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class LatencyGateConfig:
    """The latency gate of one rollout. A ratio threshold of None switches that metric's comparison off."""

    ttft_max_ratio: float | None = 1.2
    itl_max_ratio: float | None = 1.2
    quantiles: tuple[float, ...] = DEFAULT_QUANTILES
    window_seconds: float = 300.0
    min_requests: int = 50
    interval_seconds: float = 60.0
    consecutive_failure_limit: int = 3
    on_inconclusive: OnInconclusive = OnInconclusive.HOLD
    inconclusive_deadline_seconds: float = 1800.0
    bake_seconds: float = 600.0
    # Absolute ceiling on the canary's error ratio; None reports the ratio without gating on it.
    max_error_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_max_ratio", "itl_max_ratio"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a ratio above 0 (or None to skip it), got {value!r}")
        if self.ttft_max_ratio is None and self.itl_max_ratio is None:
            raise ValueError("ttft_max_ratio and itl_max_ratio are both None: the gate would compare nothing")
        if not self.quantiles or any(not 0 < q < 1 for q in self.quantiles):
            raise ValueError(f"quantiles: each must lie strictly between 0 and 1, got {self.quantiles!r}")
        if self.max_error_ratio is not None and not 0 <= self.max_error_ratio <= 1:
            raise ValueError(f"max_error_ratio: must lie in [0, 1], got {self.max_error_ratio!r}")
        positive = ("window_seconds", "interval_seconds", "inconclusive_deadline_seconds")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be above 0, got {getattr(self, name)!r}")
        if self.bake_seconds < 0:
            raise ValueError(f"bake_seconds: must be 0 or more, got {self.bake_seconds!r}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests: must be at least 1, got {self.min_requests!r}")
        if self.consecutive_failure_limit < 1:
            raise ValueError(f"consecutive_failure_limit: must be at least 1, got {self.consecutive_failure_limit!r}")
        if self.on_inconclusive not in list(OnInconclusive):
            choices = " or ".join(choice.value for choice in OnInconclusive)
            raise ValueError(f"on_inconclusive: must be {choices}, got {self.on_inconclusive!r}")
        object.__setattr__(self, "on_inconclusive", OnInconclusive(self.on_inconclusive))
        object.__setattr__(self, "quantiles", tuple(sorted(set(self.quantiles))))

    @property
    def required_passes(self) -> int:
        """Passing checks needed to promote: enough check windows to span the bake period end to end."""
        return max(1, math.ceil(self.bake_seconds / self.window_seconds))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttftMaxRatio": self.ttft_max_ratio,
            "itlMaxRatio": self.itl_max_ratio,
            "quantiles": list(self.quantiles),
            "windowSeconds": self.window_seconds,
            "minRequests": self.min_requests,
            "intervalSeconds": self.interval_seconds,
            "consecutiveFailureLimit": self.consecutive_failure_limit,
            "onInconclusive": self.on_inconclusive.value,
            "inconclusiveDeadlineSeconds": self.inconclusive_deadline_seconds,
            "bakeSeconds": self.bake_seconds,
            "maxErrorRatio": self.max_error_ratio,
        }


@dataclass(frozen=True)
class SideSelector:
    """Which pods form one side of the comparison.

    `pods` are the side's current pod names (the Prometheus provider matches them on the `pod` label), `labels` the pod
    labels that select them (available to selector templates), `endpoints` their base URLs (the scrape provider reads
    `<endpoint>/metrics`).
    """

    role: str
    namespace: str
    pods: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    endpoints: tuple[str, ...] = ()


@dataclass(frozen=True)
class SideMetrics:
    """What one side served during the window. Latency values are seconds; None where there was nothing to measure.

    Quantiles are `histogram_quantile` estimates, so each is only known to lie in its bucket: `*_bucket_bounds` are
    the histogram's upper bounds (`le`, +Inf included; empty when the quantiles are exact rather than estimated) and
    `*_mean_seconds` the mean over the window (sum / count), which the assessor compares when the bucket cannot tell
    the two sides apart.
    """

    role: str
    series_found: bool
    requests: float
    window_seconds: float
    ttft_seconds: Mapping[float, float | None]
    itl_seconds: Mapping[float, float | None]
    itl_metric: str | None = None
    error_ratio: float | None = None
    http_error_ratio: float | None = None
    kv_cache_usage: float | None = None
    ttft_mean_seconds: float | None = None
    itl_mean_seconds: float | None = None
    ttft_bucket_bounds: tuple[float, ...] = ()
    itl_bucket_bounds: tuple[float, ...] = ()
    # Requests the side finished in the window by its own counter (vllm:request_success_total): the traffic it got.
    finished_requests: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "seriesFound": self.series_found,
            "requests": round(self.requests, 3),
            "windowSeconds": round(self.window_seconds, 3),
            "ttftSeconds": {quantile_label(q): _finite_or_none(v) for q, v in sorted(self.ttft_seconds.items())},
            "itlSeconds": {quantile_label(q): _finite_or_none(v) for q, v in sorted(self.itl_seconds.items())},
            "itlMetric": self.itl_metric,
            "errorRatio": _finite_or_none(self.error_ratio),
            "httpErrorRatio": _finite_or_none(self.http_error_ratio),
            "kvCacheUsage": _finite_or_none(self.kv_cache_usage),
            "ttftMeanSeconds": _finite_or_none(self.ttft_mean_seconds),
            "itlMeanSeconds": _finite_or_none(self.itl_mean_seconds),
            "finishedRequests": _finite_or_none(self.finished_requests),
        }


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1000:g}"


def describe_bucket(bucket: tuple[float, float]) -> str:
    """(0, 0.01) -> "<= 10 ms", (0.01, 0.025) -> "10-25 ms", (80, inf) -> "> 80000 ms"."""
    lower, upper = bucket
    if math.isinf(upper):
        return f"> {_milliseconds(lower)} ms"
    if lower <= 0:
        return f"<= {_milliseconds(upper)} ms"
    return f"{_milliseconds(lower)}-{_milliseconds(upper)} ms"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


class _Comparison:
    """What a canary/baseline comparison of one statistic (a quantile or the mean) has in common."""

    metric: str  # "ttft" or "itl"
    canary_seconds: float
    baseline_seconds: float
    max_ratio: float

    @property
    def statistic(self) -> str:
        raise NotImplementedError

    @property
    def key(self) -> str:
        """e.g. "itl_p95" or "itl_mean"."""
        return f"{self.metric}_{self.statistic}"

    @property
    def ratio(self) -> float:
        return self.canary_seconds / self.baseline_seconds

    def _common_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "statistic": self.statistic,
            "canarySeconds": self.canary_seconds,
            "baselineSeconds": self.baseline_seconds,
            "ratio": round(self.ratio, 4),
            "maxRatio": self.max_ratio,
        }


@dataclass(frozen=True)
class RatioCheck(_Comparison):
    """One canary/baseline comparison of a quantile, e.g. TTFT p95.

    `shared_bucket` is the histogram bucket (lower, upper] both sides' estimates fall in, if they do: interpolation
    inside one bucket makes the two estimates nearly equal whatever the real latencies, so such a ratio is no evidence
    either way (`resolved` is False, and it never breaches); the assessor compares the means instead.
    """

    metric: str
    quantile: float
    canary_seconds: float
    baseline_seconds: float
    max_ratio: float
    shared_bucket: tuple[float, float] | None = None

    @property
    def statistic(self) -> str:
        return quantile_label(self.quantile)

    @property
    def resolved(self) -> bool:
        return self.shared_bucket is None

    @property
    def breached(self) -> bool:
        return self.resolved and self.ratio > self.max_ratio

    def describe(self) -> str:
        return (
            f"canary {self.metric.upper()} {self.statistic} {self.canary_seconds * 1000:.1f} ms is "
            f"{self.ratio:.2f}x baseline {self.baseline_seconds * 1000:.1f} ms (max {self.max_ratio:.2f}x)"
        )

    def to_dict(self) -> dict[str, Any]:
        bucket = None
        if self.shared_bucket is not None:
            lower, upper = self.shared_bucket
            bucket = [lower, None if math.isinf(upper) else upper]
        return {
            **self._common_dict(),
            "quantile": self.quantile,
            "breached": self.breached,
            "resolved": self.resolved,
            "sharedBucketSeconds": bucket,
        }


def describe_unresolved(metric: str, unresolved: tuple[RatioCheck, ...]) -> str:
    """e.g. "ITL p50 and p95 fall in one bucket (<= 10 ms) on both sides"."""
    labels = [check.statistic for check in unresolved]
    buckets = [check.shared_bucket for check in unresolved if check.shared_bucket is not None]
    verb = "falls" if len(labels) == 1 else "fall"
    if len(set(buckets)) == 1:
        return f"{metric.upper()} {_and(labels)} {verb} in one bucket ({describe_bucket(buckets[0])}) on both sides"
    placed = [f"{label} ({describe_bucket(bucket)})" for label, bucket in zip(labels, buckets, strict=True)]
    return f"{metric.upper()} {_and(placed)} fall in one bucket each on both sides"


@dataclass(frozen=True)
class MeanCheck(_Comparison):
    """A canary/baseline comparison of the mean, made in place of the quantiles of `unresolved` (one or more quantile
    comparisons of the same metric whose two estimates fell in one bucket)."""

    metric: str
    canary_seconds: float
    baseline_seconds: float
    max_ratio: float
    unresolved: tuple[RatioCheck, ...]

    @property
    def statistic(self) -> str:
        return "mean"

    @property
    def breached(self) -> bool:
        return self.ratio > self.max_ratio

    def describe(self) -> str:
        return (
            f"{describe_unresolved(self.metric, self.unresolved)}; compared means: canary "
            f"{self.canary_seconds * 1000:.1f} ms vs baseline {self.baseline_seconds * 1000:.1f} ms = "
            f"{self.ratio:.2f}x (max {self.max_ratio:.2f}x)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **self._common_dict(),
            "breached": self.breached,
            "replaces": [check.statistic for check in self.unresolved],
        }


class Evidence(Protocol):
    """What a passing check found that the status keeps (e.g. the KV cache the canary serves)."""

    def record(self, status: KVPolicyStatus) -> None: ...


@dataclass(frozen=True)
class Verdict:
    """The result of one analysis check. `reason` is CamelCase (for conditions and events), `message` for humans."""

    kind: GateVerdict
    reason: str
    message: str
    checks: tuple[RatioCheck, ...] = ()
    canary: SideMetrics | None = None
    baseline: SideMetrics | None = None
    # Mean comparisons made where quantiles were unresolved (see RatioCheck.shared_bucket).
    mean_checks: tuple[MeanCheck, ...] = ()
    # Other figures a check compared, by key (a custom check's value and ratio), kept in status with the ratios.
    values: Mapping[str, float] = field(default_factory=dict)
    # A problem only a person can fix (a query Prometheus rejects): the step posts a Warning event when it appears.
    needs_attention: bool = False
    evidence: Evidence | None = None

    @property
    def phase(self) -> AnalysisPhase:
        return self.kind.phase

    @classmethod
    def provider_unavailable(cls, error: ProviderUnavailableError) -> Verdict:
        return cls(GateVerdict.PROVIDER_UNAVAILABLE, error.reason, error.message, needs_attention=error.needs_attention)

    def ratio(self, metric: str, quantile: float) -> float | None:
        for check in self.checks:
            if check.metric == metric and check.quantile == quantile:
                return check.ratio
        return None

    def mean_ratio(self, metric: str) -> float | None:
        return next((check.ratio for check in self.mean_checks if check.metric == metric), None)

    def ratios(self) -> dict[str, float]:
        """Every ratio by key: "ttft_p50", "itl_p95", ..., and "itl_mean" where the means were compared."""
        return {check.key: round(check.ratio, 4) for check in (*self.checks, *self.mean_checks)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "reason": self.reason,
            "message": self.message,
            "checks": [check.to_dict() for check in self.checks],
            "meanChecks": [check.to_dict() for check in self.mean_checks],
            "canary": self.canary.to_dict() if self.canary else None,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            **({"values": dict(self.values)} if self.values else {}),
        }


@dataclass(frozen=True)
class AnalysisState:
    """Progress of one analysis, kept in the KVPolicy status between checks (timestamps are timezone-aware)."""

    started_at: datetime
    checks: int = 0
    passes: int = 0
    breaches: int = 0
    inconclusive: int = 0
    consecutive_breaches: int = 0
    inconclusive_since: datetime | None = None
    last_check_at: datetime | None = None
    last_verdict: GateVerdict | None = None
    last_reason: str | None = None

    @classmethod
    def start(cls, now: datetime) -> AnalysisState:
        if now.tzinfo is None:
            raise ValueError("analysis state: timestamps must be timezone-aware (use datetime.now(UTC))")
        return cls(started_at=now)

    def next_check_at(self, config: LatencyGateConfig) -> datetime:
        """An interval after the last check; the first an interval after the start (rules.next_check_at's rule)."""
        return (self.last_check_at or self.started_at) + timedelta(seconds=config.interval_seconds)


@dataclass(frozen=True)
class Outcome:
    """What the operator should do after a check. `reason` is CamelCase, `message` for humans."""

    action: Action
    reason: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action.value, "reason": self.reason, "message": self.message}
