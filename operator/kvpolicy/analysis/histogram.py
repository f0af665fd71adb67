"""Histogram arithmetic, with the same semantics as PromQL's `histogram_quantile`.

Both providers must agree on what "p95" means, so this follows Prometheus' bucketQuantile: linear interpolation
inside the bucket that holds the rank, the lowest bucket starting at 0, and the +Inf bucket answered by the highest
finite bound. An estimate is therefore only known to lie somewhere in its bucket: `bucket_containing` says which.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def bucket_containing(bounds: Sequence[float], value: float) -> tuple[float, float] | None:
    """The bucket (lower, upper] of sorted upper bounds `bounds` that holds `value`, the lowest one starting at 0;
    None without bounds. A `histogram_quantile` estimate can lie anywhere in that bucket."""
    index = bisect.bisect_left(bounds, value)
    if index == len(bounds):
        return None
    return (bounds[index - 1] if index > 0 else 0.0), bounds[index]


@dataclass(frozen=True)
class CumulativeHistogram:
    """Cumulative bucket counts keyed by upper bound (`le`, +Inf included), the number of observations, and their sum
    (the `_sum` series; None where it was not exported)."""

    buckets: Mapping[float, float]
    count: float
    total: float | None = None

    @property
    def bounds(self) -> tuple[float, ...]:
        return tuple(sorted(self.buckets))

    def minus(self, earlier: CumulativeHistogram) -> CumulativeHistogram:
        """Observations made since `earlier`; a histogram whose count went down was reset, so all of it is new."""
        if self.count < earlier.count:
            return self
        return CumulativeHistogram(
            {bound: value - earlier.buckets.get(bound, 0.0) for bound, value in self.buckets.items()},
            self.count - earlier.count,
            None if self.total is None or earlier.total is None else self.total - earlier.total,
        )

    def plus(self, other: CumulativeHistogram) -> CumulativeHistogram:
        bounds = set(self.buckets) | set(other.buckets)
        total = self.total + other.total if self.total is not None and other.total is not None else None
        return CumulativeHistogram(
            {bound: self.buckets.get(bound, 0.0) + other.buckets.get(bound, 0.0) for bound in bounds},
            self.count + other.count,
            total,
        )

    def mean(self) -> float | None:
        """The mean observation (sum / count, as PromQL's rate(_sum) / rate(_count)), None without observations."""
        if self.total is None or self.count <= 0:
            return None
        return self.total / self.count

    def quantile(self, q: float) -> float | None:
        """The q-quantile in the histogram's unit, or None when it holds no observations (PromQL returns NaN)."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile must lie in (0, 1], got {q!r}")
        bounds = sorted(self.buckets)
        if len(bounds) < 2 or not math.isinf(bounds[-1]):
            return None
        counts: list[float] = []
        for bound in bounds:  # cumulative counts can only grow; scrape races can break that, so enforce it
            counts.append(max(self.buckets[bound], counts[-1] if counts else 0.0))
        observations = counts[-1]
        if observations <= 0:
            return None
        rank = q * observations
        index = next(i for i, count in enumerate(counts) if count >= rank)
        if index == len(bounds) - 1:
            return bounds[-2]
        if index == 0 and bounds[0] <= 0:
            return bounds[0]
        start = bounds[index - 1] if index > 0 else 0.0
        below = counts[index - 1] if index > 0 else 0.0
        return start + (bounds[index] - start) * (rank - below) / (counts[index] - below)
