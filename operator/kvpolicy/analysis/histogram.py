"""Histogram arithmetic for the scrape provider, with the same semantics as PromQL's `histogram_quantile`.

Both providers must agree on what "p95" means, so this follows Prometheus' bucketQuantile: linear interpolation
inside the bucket that holds the rank, the lowest bucket starting at 0, and the +Inf bucket answered by the highest
finite bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CumulativeHistogram:
    """Cumulative bucket counts keyed by upper bound (`le`, +Inf included), and the number of observations."""

    buckets: Mapping[float, float]
    count: float

    def minus(self, earlier: CumulativeHistogram) -> CumulativeHistogram:
        """Observations made since `earlier`; a histogram whose count went down was reset, so all of it is new."""
        if self.count < earlier.count:
            return self
        return CumulativeHistogram(
            {bound: value - earlier.buckets.get(bound, 0.0) for bound, value in self.buckets.items()},
            self.count - earlier.count,
        )

    def plus(self, other: CumulativeHistogram) -> CumulativeHistogram:
        bounds = set(self.buckets) | set(other.buckets)
        return CumulativeHistogram(
            {bound: self.buckets.get(bound, 0.0) + other.buckets.get(bound, 0.0) for bound in bounds},
            self.count + other.count,
        )

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
