"""Custom checks (spec.analysis.checks), one metrics-check entry each: a named PromQL query evaluated through the
Prometheus provider on every check of the live latency analysis, with its value held to a range and, optionally, its
canary/baseline ratio to another.

The query names the canary's series with `{{ canary }}` (the label matchers of the selector template); for the ratio
the same query runs again with the baseline's matchers in its place. `{{ baseline }}` always stands for the
baseline's matchers and `{{ window }}` for the analysis window (e.g. `300s`). No series, or NaN (0/0), is NoData.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from kvpolicy.analysis.checks import MetricsCheck, Sides, Stage
from kvpolicy.analysis.model import ProviderUnavailableError, Verdict
from kvpolicy.analysis.provider import MetricsProvider, QueryRejectedError
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.api.v1alpha1 import Bounds, CustomCheck, GateVerdict, KVPolicy


def render_query(query: str, measured: str, baseline: str, window_seconds: int) -> str:
    """The query with its placeholders filled: `measured` for {{ canary }}, `baseline` for {{ baseline }}."""
    return (
        query.replace("{{ canary }}", measured)
        .replace("{{ baseline }}", baseline)
        .replace("{{ window }}", f"{window_seconds}s")
    )


@dataclass(frozen=True)
class Range:
    """Inclusive bounds parsed from the spec's decimal strings; None leaves that side open."""

    low: float | None
    high: float | None

    @classmethod
    def of(cls, bounds: Bounds) -> Range:
        def parse(text: str | None) -> float | None:
            return float(Decimal(text)) if text is not None else None

        return cls(parse(bounds.min), parse(bounds.max))

    def outside(self, value: float) -> str | None:
        """How a value leaves the range ("above max 0.01"), or None when it is inside."""
        if self.low is not None and value < self.low:
            return f"below min {self.low:g}"
        if self.high is not None and value > self.high:
            return f"above max {self.high:g}"
        return None


@dataclass(frozen=True)
class CustomReading:
    """The query's value on the canary and, when a ratio is checked, on the baseline (None: no series, or NaN)."""

    canary: float | None
    baseline: float | None = None


def _one_value(name: str, promql: str, values: list[float]) -> float | None:
    if len(values) > 1:
        raise ProviderUnavailableError(
            AnalysisReason.CUSTOM_CHECK_QUERY_REJECTED,
            f"custom check {name}: {promql!r} returned {len(values)} series; aggregate it to one (sum, avg, max)",
            needs_attention=True,
        )
    return values[0] if values and math.isfinite(values[0]) else None


def _describe(value: float) -> str:
    return f"{value:.4g}"


@dataclass(frozen=True)
class CustomMetricsCheck:
    """Builds the entry of one custom check of the spec."""

    spec: CustomCheck

    async def read(self, provider: MetricsProvider, policy: KVPolicy, sides: Sides) -> CustomReading:
        name = self.spec.name
        promql = provider.promql()
        if promql is None:
            raise ProviderUnavailableError(
                AnalysisReason.CUSTOM_CHECK_NEEDS_PROMETHEUS,
                f"custom check {name} runs only through gates.latency.provider Prometheus",
                needs_attention=True,
            )
        window = sides.window_seconds
        canary, baseline = promql.matchers(sides.canary), promql.matchers(sides.baseline)
        try:
            on_canary = render_query(self.spec.query, canary, baseline, window)
            value = _one_value(name, on_canary, await promql.query(on_canary))
            if self.spec.baseline_ratio is None:
                return CustomReading(value)
            on_baseline = render_query(self.spec.query, baseline, baseline, window)
            return CustomReading(value, _one_value(name, on_baseline, await promql.query(on_baseline)))
        except QueryRejectedError as error:
            raise ProviderUnavailableError(
                AnalysisReason.CUSTOM_CHECK_QUERY_REJECTED,
                f"custom check {name}: {error.message}; fix spec.analysis.checks",
                needs_attention=True,
            ) from None

    def assess(self, policy: KVPolicy, reading: CustomReading) -> Verdict:
        return assess_custom(self.spec, reading)

    def entry(self) -> MetricsCheck[CustomReading]:
        return MetricsCheck(name=f"custom/{self.spec.name}", stage=Stage.ANALYSIS, read=self.read, assess=self.assess)


def assess_custom(check: CustomCheck, reading: CustomReading) -> Verdict:
    """Judge one custom check: NoData without a canary value (or a baseline one when a ratio is asked, or a baseline
    of 0), Breach when the value or the ratio leaves its range, else Pass."""
    name = check.name
    if reading.canary is None:
        message = f"custom check {name}: its query returned no series (or NaN) for the canary"
        return Verdict(GateVerdict.NO_DATA, AnalysisReason.CUSTOM_CHECK_NO_DATA, message)
    values = {name: reading.canary}
    ratio: float | None = None
    if check.baseline_ratio is not None:
        if reading.baseline is None or reading.baseline == 0:
            missing = "no series (or NaN)" if reading.baseline is None else "0, so no ratio"
            message = f"custom check {name}: its query returned {missing} for the baseline"
            return Verdict(GateVerdict.NO_DATA, AnalysisReason.CUSTOM_CHECK_NO_DATA, message, values=values)
        ratio = reading.canary / reading.baseline
        values[f"{name}_ratio"] = round(ratio, 4)
    breaches: list[str] = []
    if check.range is not None and (outside := Range.of(check.range).outside(reading.canary)) is not None:
        breaches.append(f"canary value {_describe(reading.canary)} is {outside}")
    if check.baseline_ratio is not None and ratio is not None:
        outside = Range.of(check.baseline_ratio).outside(ratio)
        if outside is not None:
            assert reading.baseline is not None
            breaches.append(
                f"canary/baseline {_describe(reading.canary)}/{_describe(reading.baseline)} = {ratio:.3f}x is {outside}"
            )
    if breaches:
        message = f"custom check {name}: {'; '.join(breaches)}"
        return Verdict(GateVerdict.BREACH, AnalysisReason.CUSTOM_CHECK_BREACHED, message, values=values)
    within = f"canary value {_describe(reading.canary)}"
    if ratio is not None:
        within += f", {ratio:.3f}x the baseline"
    message = f"custom check {name}: {within}, within range"
    return Verdict(GateVerdict.PASS, AnalysisReason.WITHIN_THRESHOLDS, message, values=values)


def custom_checks(policy: KVPolicy) -> tuple[MetricsCheck[CustomReading], ...]:
    """The entries of the policy's custom checks, in the spec's order."""
    analysis = policy.spec.analysis
    return tuple(CustomMetricsCheck(check).entry() for check in analysis.checks) if analysis else ()
