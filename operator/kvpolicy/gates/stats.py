"""Sequential tests on paired needle answers: is recovery (canary score / baseline score) above or below a bar, and is
the baseline strong enough to judge by?

Each scored needle gives a pair (canary right?, baseline right?). Recovery R >= r exactly when X = canary - r·baseline
has a mean >= 0, so "R above r" and "R below r" are two one-sided tests of the mean of a bounded variable. Each is a
test by betting (Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", 2023): a wealth that
starts at 1 and stakes a fraction of itself on every needle, the fraction chosen from the needles before it alone.
While the tested hypothesis holds the wealth is a nonnegative supermartingale, so by Ville's inequality it ever reaches
1/alpha with probability at most alpha, however often it is looked at: the gate may stop after any prompt, and a
decision is wrong with probability at most alpha (= 1 - confidence). The guarantee assumes the needles' outcomes are
independent given their probabilities; needles of one prompt may in truth fail together
(bench/accuracy_gate_efficiency.py measures what that costs).

Only discordant needles and the baseline's right answers move the wealth: a both-right needle gains (1 - r) for the
"above" test, a both-wrong one changes nothing, a needle only the baseline got costs r, one only the canary got gains 1.
An A/A run with identical answers therefore passes once about ln(1/alpha) / -ln(r) needles are right on both sides
(~60 at r = 0.95, alpha = 0.05), the least any valid test can need: had the canary lost a (1 - r) share of them, seeing
none lost would be that unlikely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

# The largest fraction of the wealth staked on one observation, as a share of what its worst outcome can take: betting
# it all would let one unlucky needle end the test for good. At 0.9 an identical A/A passes within 5% of the prompts
# 0.95 needs (33 vs 31 at baseline 0.5, 4 asked) and a canary that swaps a few needles both ways passes more often
# than at 0.95; 0.75 costs the A/A 20% more (bench/accuracy_gate_efficiency.py --stake-caps, BENCHMARKS.md).
STAKE_CAP = 0.9
# Thresholds the reported recovery bounds are read from: 0.01 steps up to twice the baseline's score.
BOUND_GRID = np.round(np.arange(0.01, 2.0001, 0.01), 2)

Floats = npt.NDArray[np.float64]


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

    @property
    def recovery(self) -> float | None:
        baseline_right = self.both + self.baseline_only
        return (self.both + self.canary_only) / baseline_right if baseline_right else None


@dataclass(frozen=True)
class Wager:
    """A test by betting that the mean of observations x >= -worst is <= 0, for several nulls at once (one per entry).

    Before each observation it stakes the fraction clip(mean / mean square, 0, STAKE_CAP / worst) of its wealth, the
    growth-optimal bet to second order (aGRAPA), from the observations so far and one pseudo-observation `prior` (the
    value the alternative expects, so the first bet is not zero). The wealth becomes wealth · (1 + stake · x), kept as
    its logarithm."""

    cap: Floats
    log_wealth: Floats
    total: Floats
    squares: Floats

    @classmethod
    def start(cls, worst: Floats, prior: Floats) -> Wager:
        # The mean square starts a hair above zero so that a zero prior (a floor of 0) stakes nothing, not 0/0.
        squares = prior * prior + 1e-12
        return cls(cap=STAKE_CAP / worst, log_wealth=np.zeros_like(worst), total=prior, squares=squares)

    def stake(self) -> Floats:
        stake: Floats = np.minimum(np.maximum(self.total / self.squares, 0.0), self.cap)
        return stake

    def observe(self, x: Floats) -> Wager:
        return Wager(
            cap=self.cap,
            log_wealth=self.log_wealth + np.log1p(self.stake() * x),
            total=self.total + x,
            squares=self.squares + x * x,
        )


def _recovery_wagers(thresholds: Floats) -> tuple[Wager, Wager]:
    """(above, below): "recovery > r" bets on x = canary - r·baseline (worst -r), "recovery < r" on its negative
    (worst -1). A priori each expects a needle that favours it: both right (x = 1 - r; only the canary right, x = 1,
    for r >= 1), and only the baseline right."""
    above = Wager.start(worst=thresholds, prior=np.where(thresholds < 1.0, 1.0 - thresholds, 1.0))
    below = Wager.start(worst=np.ones_like(thresholds), prior=thresholds.copy())
    return above, below


@dataclass(frozen=True)
class Evidence:
    """What the needles so far show, updated one needle at a time.

    `above[i]` / `below[i]` test recovery against `thresholds[i]` (index 0 is the gate's bar, the rest the grid the
    reported bounds come from); `weak` tests whether the baseline's score is below `floor`."""

    thresholds: Floats
    floor: float
    above: Wager
    below: Wager
    weak: Wager
    counts: PairedCounts = field(default_factory=PairedCounts)

    @classmethod
    def start(cls, min_recovery: float, floor: float, bounds: bool = True) -> Evidence:
        """Evidence for a gate with this bar and baseline floor; `bounds=False` tests the bar alone (cheaper, no
        reported bounds: for benchmarks that only need the decision)."""
        thresholds = np.array([min_recovery, *(BOUND_GRID if bounds else ())], dtype=np.float64)
        above, below = _recovery_wagers(thresholds)
        # "baseline score < floor" bets on floor - baseline (worst floor - 1), expecting a wrong baseline answer.
        weak = Wager.start(worst=np.array([1.0 - floor]), prior=np.array([floor]))
        return cls(thresholds=thresholds, floor=floor, above=above, below=below, weak=weak)

    def add(self, canary: bool, baseline: bool) -> Evidence:
        x = float(canary) - self.thresholds * float(baseline)
        return replace(
            self,
            above=self.above.observe(x),
            below=self.below.observe(-x),
            weak=self.weak.observe(np.array([self.floor - float(baseline)])),
            counts=self.counts.add(canary, baseline),
        )

    def above_bar(self, alpha: float) -> bool:
        """Recovery is shown above the gate's bar (false with probability at most alpha, at any stopping time)."""
        return bool(self.above.log_wealth[0] >= -math.log(alpha))

    def below_bar(self, alpha: float) -> bool:
        return bool(self.below.log_wealth[0] >= -math.log(alpha))

    def baseline_too_weak(self, alpha: float) -> bool:
        """The baseline's score is shown below the floor."""
        return bool(self.weak.log_wealth[0] >= -math.log(alpha))

    def bounds(self, alpha: float) -> RecoveryBounds:
        """The recovery interval the tests leave open: above the largest threshold (the bar or a grid point) the
        "above" test rejects, below the smallest one the "below" test rejects (0 and the grid's top when none does).
        So a Pass's lower bound is at least the bar, a Fail's upper bound at most the bar."""
        if self.thresholds.size == 1:
            raise ValueError("this Evidence was started without bounds")
        enough = -math.log(alpha)
        shown_above = self.thresholds[self.above.log_wealth >= enough]
        shown_below = self.thresholds[self.below.log_wealth >= enough]
        low = float(shown_above.max()) if shown_above.size else 0.0
        high = float(shown_below.min()) if shown_below.size else float(BOUND_GRID[-1])
        return RecoveryBounds(point=self.counts.recovery, low=low, high=high)


@dataclass(frozen=True)
class RecoveryBounds:
    point: float | None
    low: float
    high: float
