"""Quantiles from cumulative buckets, with PromQL histogram_quantile's semantics (cross-checked against a real
Prometheus in test_analysis_real_prometheus.py)."""

from __future__ import annotations

import math

import pytest
from kvpolicy.analysis.histogram import CumulativeHistogram

INF = math.inf


def hist(buckets: dict[float, float]) -> CumulativeHistogram:
    return CumulativeHistogram(buckets, buckets[INF])


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        # 10 observations in (0.1, 0.2]: the median interpolates to the middle of that bucket.
        ({0.1: 0, 0.2: 10, INF: 10}, 0.5, 0.15),
        # The lowest bucket starts at 0.
        ({0.1: 10, 0.2: 10, INF: 10}, 0.5, 0.05),
        ({0.1: 5, 0.2: 10, INF: 10}, 0.95, 0.19),
        # A rank in the +Inf bucket answers the highest finite bound.
        ({0.1: 5, 0.2: 6, INF: 10}, 0.95, 0.2),
        # Non-monotonic counts (a scrape race) are flattened as Prometheus does.
        ({0.1: 6, 0.2: 5, 0.4: 10, INF: 10}, 0.5, 0.1 * 5 / 6),
        ({0.1: 2, 0.2: 4, 0.4: 8, INF: 8}, 1.0, 0.4),
    ],
)
def test_quantile(buckets: dict[float, float], q: float, expected: float) -> None:
    assert hist(buckets).quantile(q) == pytest.approx(expected)


@pytest.mark.parametrize(
    "histogram",
    [
        CumulativeHistogram({0.1: 0, INF: 0}, 0),  # no observations: PromQL gives NaN
        CumulativeHistogram({0.1: 3, 0.2: 4}, 4),  # no +Inf bucket
        CumulativeHistogram({INF: 4}, 4),  # only +Inf
        CumulativeHistogram({}, 0),
    ],
)
def test_quantile_undefined(histogram: CumulativeHistogram) -> None:
    assert histogram.quantile(0.5) is None


@pytest.mark.parametrize("q", [0.0, -0.1, 1.1])
def test_quantile_out_of_range(q: float) -> None:
    with pytest.raises(ValueError, match="quantile must lie in"):
        hist({0.1: 1, INF: 1}).quantile(q)


def test_minus_and_plus() -> None:
    earlier = CumulativeHistogram({0.1: 3, 0.2: 5, INF: 6}, 6, 0.75)
    now = CumulativeHistogram({0.1: 4, 0.2: 9, INF: 10}, 10, 1.5)
    assert now.minus(earlier) == CumulativeHistogram({0.1: 1, 0.2: 4, INF: 4}, 4, 0.75)
    assert now.minus(earlier).plus(earlier) == now
    assert now.minus(earlier).mean() == pytest.approx(0.75 / 4)


def test_minus_after_a_reset_keeps_everything() -> None:
    before_restart = CumulativeHistogram({0.1: 30, INF: 40}, 40, 8.0)
    after_restart = CumulativeHistogram({0.1: 2, INF: 3}, 3, 0.3)
    assert after_restart.minus(before_restart) == after_restart
    assert after_restart.minus(before_restart).mean() == pytest.approx(0.1)


@pytest.mark.parametrize(
    "histogram",
    [
        CumulativeHistogram({0.1: 0, INF: 0}, 0, 0.0),  # no observations
        CumulativeHistogram({0.1: 2, INF: 2}, 2),  # no _sum series
        CumulativeHistogram({0.1: 2, INF: 2}, 2, 0.1).plus(CumulativeHistogram({0.1: 1, INF: 1}, 1)),
    ],
)
def test_mean_undefined(histogram: CumulativeHistogram) -> None:
    assert histogram.mean() is None


def test_bounds_are_sorted_upper_bounds() -> None:
    assert hist({INF: 3, 0.2: 2, 0.1: 1}).bounds == (0.1, 0.2, INF)
