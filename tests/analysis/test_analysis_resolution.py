"""Quantiles that vLLM's fixed buckets cannot resolve: when both sides' estimates fall in one bucket, the assessor
compares the means instead, says so, and never passes without them."""

from __future__ import annotations

import json
import math

import pytest
from fake_vllm import ITL_BUCKETS, TTFT_BUCKETS
from kvpolicy.analysis.histogram import bucket_containing
from kvpolicy.analysis.model import LatencyGateConfig, SideMetrics, describe_bucket
from kvpolicy.analysis.verdicts import assess
from kvpolicy.api.v1alpha1 import GateVerdict

CONFIG = LatencyGateConfig(ttft_max_ratio=1.2, itl_max_ratio=1.2, quantiles=(0.5, 0.95), min_requests=20)
ITL_BOUNDS = (*ITL_BUCKETS, math.inf)
TTFT_BOUNDS = (*TTFT_BUCKETS, math.inf)


def side(
    role: str,
    itl: tuple[float, float] = (0.005, 0.0095),
    itl_mean: float | None = 0.0052,
    ttft: tuple[float, float] = (0.15, 0.2),
    ttft_mean: float | None = 0.16,
) -> SideMetrics:
    """Metrics as a provider reports them from vLLM's histograms. The defaults: ITL below 10 ms (vLLM's first ITL
    bucket, where p50 and p95 interpolate to 5 and 9.5 ms whatever the real latency); TTFT equal on both sides, so
    also unresolved (equal estimates share their bucket), with equal means."""
    return SideMetrics(
        role=role,
        series_found=True,
        requests=100,
        window_seconds=300,
        ttft_seconds=dict(zip((0.5, 0.95), ttft, strict=True)),
        itl_seconds=dict(zip((0.5, 0.95), itl, strict=True)),
        itl_metric="inter_token_latency_seconds",
        ttft_mean_seconds=ttft_mean,
        itl_mean_seconds=itl_mean,
        ttft_bucket_bounds=TTFT_BOUNDS,
        itl_bucket_bounds=ITL_BOUNDS,
    )


BASELINE = side("baseline")


@pytest.mark.parametrize(
    ("canary", "baseline", "kind", "reason", "message"),
    [
        pytest.param(
            side("canary", itl=(0.0105, 0.026), ttft=(0.15, 0.3)),
            side("baseline", itl=(0.0095, 0.024)),
            GateVerdict.BREACH,
            "TTFTRatioExceeded",
            "canary TTFT p95 300.0 ms is 1.50x baseline 200.0 ms (max 1.20x)",
            id="resolved-quantile-breach",
        ),
        # ITL estimates in different buckets on each side: they resolve, no mean is needed (nor read).
        pytest.param(
            side("canary", itl=(0.0102, 0.026), itl_mean=None),
            side("baseline", itl=(0.0095, 0.024), itl_mean=None),
            GateVerdict.PASS,
            "WithinThresholds",
            "all 3 comparisons within thresholds",
            id="resolved-quantile-pass",
        ),
        # The regression the quantiles cannot see: both sides' ITL sit in (0, 10 ms].
        pytest.param(
            side("canary", itl_mean=0.0069),
            BASELINE,
            GateVerdict.BREACH,
            "ITLRatioExceeded",
            "ITL p50 and p95 fall in one bucket (<= 10 ms) on both sides; compared means: canary 6.9 ms vs baseline "
            "5.2 ms = 1.33x (max 1.20x)",
            id="unresolved-mean-breach",
        ),
        pytest.param(
            side("canary", itl_mean=0.0055),
            BASELINE,
            GateVerdict.PASS,
            "WithinThresholds",
            "ITL p50 and p95 fall in one bucket (<= 10 ms) on both sides; compared means: canary 5.5 ms vs baseline "
            "5.2 ms = 1.06x (max 1.20x)",
            id="unresolved-mean-pass",
        ),
        # Interpolation inside one bucket can also fake a difference (more of the canary's mass in higher buckets):
        # not evidence either, the equal means decide.
        pytest.param(
            side("canary", itl=(0.0083, 0.0098), itl_mean=0.0052),
            BASELINE,
            GateVerdict.PASS,
            "WithinThresholds",
            "compared means: canary 5.2 ms vs baseline 5.2 ms = 1.00x",
            id="unresolved-ratio-is-no-breach",
        ),
        pytest.param(
            side("canary", itl_mean=None),
            BASELINE,
            GateVerdict.NO_DATA,
            "MissingLatencyMean",
            "ITL p50 and p95 fall in one bucket (<= 10 ms) on both sides, and the canary has no ITL mean",
            id="mean-missing-canary",
        ),
        pytest.param(
            side("canary"),
            side("baseline", itl_mean=None),
            GateVerdict.NO_DATA,
            "MissingLatencyMean",
            "and the baseline has no ITL mean",
            id="mean-missing-baseline",
        ),
        # p95 resolves and breaches on its own; p50 does not resolve, so its mean is compared (and passes).
        pytest.param(
            side("canary", itl=(0.005, 0.03), itl_mean=0.0053),
            side("baseline", itl=(0.005, 0.02)),
            GateVerdict.BREACH,
            "ITLRatioExceeded",
            "canary ITL p95 30.0 ms is 1.50x baseline 20.0 ms (max 1.20x)",
            id="partly-resolved",
        ),
        pytest.param(
            side("canary", itl=(0.005, 0.02), itl_mean=0.008),
            side("baseline", itl=(0.005, 0.015), itl_mean=0.006),
            GateVerdict.BREACH,
            "ITLRatioExceeded",
            "ITL p50 (<= 10 ms) and p95 (10-25 ms) fall in one bucket each on both sides; compared means",
            id="unresolved-in-two-buckets",
        ),
        pytest.param(
            side("canary", ttft=(0.05, 0.059), ttft_mean=0.065, itl_mean=0.0069),
            side("baseline", ttft=(0.05, 0.059), ttft_mean=0.05),
            GateVerdict.BREACH,
            "LatencyRatioExceeded",
            "TTFT p50 and p95 fall in one bucket (40-60 ms) on both sides; compared means: canary 65.0 ms vs "
            "baseline 50.0 ms = 1.30x (max 1.20x); ITL p50 and p95",
            id="both-metrics-on-means",
        ),
    ],
)
def test_assess_with_bucket_resolution(
    canary: SideMetrics, baseline: SideMetrics, kind: GateVerdict, reason: str, message: str
) -> None:
    verdict = assess(CONFIG, canary, baseline)
    assert (verdict.kind, verdict.reason) == (kind, reason), verdict.message
    assert message in verdict.message


def test_unresolved_ratios_are_kept_but_never_breach() -> None:
    verdict = assess(CONFIG, side("canary", itl_mean=0.0069), BASELINE)
    itl = [check for check in verdict.checks if check.metric == "itl"]
    assert [(check.ratio, check.resolved, check.breached) for check in itl] == [(1.0, False, False)] * 2
    assert {check.shared_bucket for check in itl} == {(0.0, 0.01)}
    assert verdict.mean_ratio("itl") == pytest.approx(0.0069 / 0.0052)
    assert verdict.ratios() == {
        "ttft_p50": 1.0,
        "ttft_p95": 1.0,
        "itl_p50": 1.0,
        "itl_p95": 1.0,
        "ttft_mean": 1.0,
        "itl_mean": round(0.0069 / 0.0052, 4),
    }


def test_resolved_quantiles_need_no_mean() -> None:
    canary = side("canary", ttft=(0.15, 0.3), ttft_mean=None)
    verdict = assess(CONFIG, canary, side("baseline", ttft=(0.09, 0.2), ttft_mean=None))
    assert (verdict.kind, verdict.reason) == (GateVerdict.BREACH, "TTFTRatioExceeded")
    assert verdict.mean_ratio("ttft") is None


def test_metric_without_threshold_needs_no_mean() -> None:
    verdict = assess(LatencyGateConfig(itl_max_ratio=None, min_requests=20), side("canary", itl_mean=None), BASELINE)
    assert verdict.kind is GateVerdict.PASS and verdict.mean_ratio("itl") is None


def test_exact_quantiles_without_bounds_are_compared_as_they_are() -> None:
    exact = SideMetrics("canary", True, 100, 300, {0.5: 0.15, 0.95: 0.2}, {0.5: 0.0069, 0.95: 0.0095})
    reference = SideMetrics("baseline", True, 100, 300, {0.5: 0.15, 0.95: 0.2}, {0.5: 0.0052, 0.95: 0.0095})
    verdict = assess(CONFIG, exact, reference)
    assert (verdict.kind, verdict.reason) == (GateVerdict.BREACH, "ITLRatioExceeded")
    assert verdict.mean_checks == ()


def test_mean_check_serialises_to_json() -> None:
    verdict = assess(CONFIG, side("canary", itl_mean=0.0069), BASELINE)
    data = json.loads(json.dumps(verdict.to_dict(), allow_nan=False))
    assert data["meanChecks"][1] == {
        "metric": "itl",
        "statistic": "mean",
        "canarySeconds": 0.0069,
        "baselineSeconds": 0.0052,
        "ratio": round(0.0069 / 0.0052, 4),
        "maxRatio": 1.2,
        "breached": True,
        "replaces": ["p50", "p95"],
    }
    assert data["checks"][2]["sharedBucketSeconds"] == [0.0, 0.01]
    assert (data["canary"]["itlMeanSeconds"], data["baseline"]["itlMeanSeconds"]) == (0.0069, 0.0052)


def test_estimates_in_the_inf_bucket_do_not_resolve() -> None:
    # histogram_quantile answers the highest finite bound for ranks in +Inf: both sides read 80 s.
    slow = side("canary", itl=(80.0, 80.0), itl_mean=120.0)
    verdict = assess(CONFIG, slow, side("baseline", itl=(80.0, 80.0), itl_mean=90.0))
    assert (verdict.kind, verdict.reason) == (GateVerdict.BREACH, "ITLRatioExceeded")
    assert "(40000-80000 ms)" in verdict.message


@pytest.mark.parametrize(
    ("value", "bucket"),
    [(0.005, (0.0, 0.01)), (0.01, (0.0, 0.01)), (0.0100001, (0.01, 0.025)), (81.0, (80.0, math.inf))],
)
def test_bucket_containing(value: float, bucket: tuple[float, float]) -> None:
    assert bucket_containing(ITL_BOUNDS, value) == bucket


def test_bucket_containing_without_bounds() -> None:
    assert bucket_containing((), 0.005) is None
    assert bucket_containing((0.01, 0.025), 0.03) is None  # no +Inf bound: above the last bucket


@pytest.mark.parametrize(
    ("bucket", "text"),
    [
        ((0.0, 0.01), "<= 10 ms"),
        ((0.04, 0.06), "40-60 ms"),
        ((0.0025, 0.005), "2.5-5 ms"),
        ((80.0, math.inf), "> 80000 ms"),
    ],
)
def test_describe_bucket(bucket: tuple[float, float], text: str) -> None:
    assert describe_bucket(bucket) == text
