"""Recovery (canary score / baseline score) of paired needle answers, with a credible interval.

Each scored needle gives a pair (canary right?, baseline right?). The four cell probabilities get a Dirichlet
posterior under Jeffreys' prior (1/2 per cell), and recovery = P(canary right) / P(baseline right) is summarised by
the equal-tailed interval of Monte Carlo draws. Pairing matters: when both sides fail the same hard prompts, only the
discordant pairs carry evidence, so the interval narrows far faster than for two independent scores. Jeffreys' prior
keeps it honest when nothing discordant has been seen yet (a clean run still needs ~60 needles to clear 0.95).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

POSTERIOR_DRAWS = 20000
JEFFREYS = 0.5


@dataclass(frozen=True)
class PairedCounts:
    both: int = 0
    canary_only: int = 0
    baseline_only: int = 0
    neither: int = 0

    def add(self, canary: bool, baseline: bool) -> PairedCounts:
        return PairedCounts(
            both=self.both + (canary and baseline),
            canary_only=self.canary_only + (canary and not baseline),
            baseline_only=self.baseline_only + (baseline and not canary),
            neither=self.neither + (not canary and not baseline),
        )

    @property
    def total(self) -> int:
        return self.both + self.canary_only + self.baseline_only + self.neither

    @property
    def canary_score(self) -> float:
        return (self.both + self.canary_only) / self.total if self.total else math.nan

    @property
    def baseline_score(self) -> float:
        return (self.both + self.baseline_only) / self.total if self.total else math.nan


@dataclass(frozen=True)
class RecoveryInterval:
    point: float | None
    low: float
    high: float


def recovery_interval(counts: PairedCounts, confidence: float, seed: int = 0) -> RecoveryInterval:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    baseline_right = counts.both + counts.baseline_only
    point = (counts.both + counts.canary_only) / baseline_right if baseline_right else None
    alpha = np.array([counts.both, counts.canary_only, counts.baseline_only, counts.neither], dtype=float) + JEFFREYS
    draws = np.random.default_rng(seed).dirichlet(alpha, POSTERIOR_DRAWS)
    recovery = (draws[:, 0] + draws[:, 1]) / (draws[:, 0] + draws[:, 2])
    tail = (1 - confidence) / 2
    low, high = np.quantile(recovery, [tail, 1 - tail])
    return RecoveryInterval(point=point, low=float(low), high=float(high))
