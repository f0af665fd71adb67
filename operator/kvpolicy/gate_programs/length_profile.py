"""The accuracy gate's length profile: scores per context-length bucket, an AUC across them, and whether the canary
sits below the baseline in every bucket (a systematic shift) even when the decision at the longest length passes.

Buckets halve the gate's length: with 4 buckets at 128k they are 16k, 32k, 64k and 128k. Every bucket answers the
same seeded samples (the same needles at each length), one prompt per bucket per round, while the sequential tests of
`stats` decide at the longest length alone: the profile never delays or changes that decision (the decision at the
maximum length stays the gate's), it only reports what the shorter buckets saw by the time the gate stopped.

AUC: per side, the trapezoid of the score over log2(length), divided by the log2 span, i.e. the mean score across
the profile with every doubling of length weighted alike (the vLLM FP8 KV blog reports pass@1 per length bin and an
AUC across bins). With halving buckets it is (s_1/2 + s_2 + ... + s_{K-1} + s_K/2) / (K - 1); one bucket's AUC is its
score. The AUC recovery is canary AUC / baseline AUC.

Systematic shift: the test is a stratified sign test on the paired needles. A needle both sides answered alike says
nothing about a shift; a discordant one is canary-only or baseline-only. Were the canary no worse than the baseline in
any bucket, each discordant needle would be baseline-only with probability at most 1/2, whatever the bucket's
difficulty, so the count of baseline-only needles among all D discordant ones, pooled over the buckets, is at most
Binomial(D, 1/2): the one-sided p-value is P(Binomial(D, 1/2) >= baseline-only). A systematic shift is flagged when
that p-value is at most 1 - confidence AND the canary's score is below the baseline's in every bucket (the blog's
"consistently negative across context-length buckets"). Why this test:
- a sign test over the buckets' signs alone (all K negative: p = 2^-K) cannot reach 95% with 4 buckets (1/16) and
  ignores how many needles each sign rests on; pooling the needles' signs is exact for any number of buckets;
- a trend test (Cochran-Armitage over log-length) looks for a loss that grows with length: that is the FP8
  accumulation cliff, which the decision at the longest length already catches; the shift this looks for is flat
  (miscalibrated KV scales lose a little at every length), and a flat shift has no trend to find;
- requiring every bucket below keeps a loss at one length (which the max-length decision judges) from being called
  systematic.
The test is read once, when the gate stops. The stop depends on the longest bucket's needles: a Pass comes sooner the
fewer needles the canary loses there, so at a Pass (the one verdict the flag matters for) the test is conservative.
Needles are taken as independent, as in `stats`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpolicy.api.v1alpha1 import MAX_PROFILE_BUCKETS
from kvpolicy.gate_programs.stats import PairedCounts


def bucket_lengths(longest: int, buckets: int) -> tuple[int, ...]:
    """The profile's lengths, shortest first: `longest` halved `buckets - 1` times, ..., `longest`."""
    if not 1 <= buckets <= MAX_PROFILE_BUCKETS:
        raise ValueError(f"buckets must be between 1 and {MAX_PROFILE_BUCKETS}, got {buckets}")
    if longest >> (buckets - 1) < 1:
        raise ValueError(f"{longest} tokens cannot be halved {buckets - 1} times")
    return tuple(longest >> (buckets - 1 - index) for index in range(buckets))


def auc(lengths: Sequence[int], scores: Sequence[float]) -> float:
    """The trapezoid of `scores` over log2(`lengths`) divided by the log2 span: the mean score per doubling of
    length. One length: its score. Lengths must increase."""
    if len(lengths) != len(scores) or not lengths:
        raise ValueError("auc needs one score per length, and at least one")
    if any(later <= earlier for earlier, later in itertools.pairwise(lengths)):
        raise ValueError(f"auc needs increasing lengths, got {list(lengths)}")
    if len(lengths) == 1:
        return float(scores[0])
    positions = [math.log2(length) for length in lengths]
    area = sum(
        (right - left) * (low + high) / 2
        for left, right, low, high in zip(positions, positions[1:], scores, scores[1:], strict=False)
    )
    return area / (positions[-1] - positions[0])


def sign_test_p(baseline_only: int, canary_only: int) -> float:
    """One-sided exact sign test: P(Binomial(n, 1/2) >= baseline_only) with n = baseline_only + canary_only, the
    chance of at least this many baseline-only needles among the discordant ones were neither side better. 1.0 when
    no needle is discordant."""
    if baseline_only < 0 or canary_only < 0:
        raise ValueError("needle counts cannot be negative")
    n = baseline_only + canary_only
    tail = sum(math.comb(n, k) for k in range(baseline_only, n + 1))
    # Exact integers: n reaches thousands of needles, past what 2.0**n holds.
    return tail / (1 << n)


@dataclass(frozen=True)
class Bucket:
    """One length's paired needles and the prompts they came from."""

    length: int
    prompts: int
    counts: PairedCounts


@dataclass(frozen=True)
class ShiftTest:
    """The stratified sign test over the buckets (see the module's docstring)."""

    systematic: bool
    p_value: float
    negative_buckets: int  # buckets whose canary score is below the baseline's
    buckets: int
    canary_only: int
    baseline_only: int


@dataclass(frozen=True)
class Profile:
    buckets: tuple[Bucket, ...]
    canary_auc: float | None  # None when a bucket has no needle yet
    baseline_auc: float | None
    shift: ShiftTest

    @property
    def auc_recovery(self) -> float | None:
        if self.canary_auc is None or not self.baseline_auc:
            return None
        return self.canary_auc / self.baseline_auc


def shift_test(counts: Sequence[PairedCounts], alpha: float) -> ShiftTest:
    """Is the canary below the baseline in every bucket, shown at level `alpha`? Needs at least two buckets: one
    bucket is the gate's own decision, not a profile."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1, got {alpha}")
    baseline_only = sum(c.baseline_only for c in counts)
    canary_only = sum(c.canary_only for c in counts)
    negative = sum(c.baseline_only > c.canary_only for c in counts)
    p_value = sign_test_p(baseline_only, canary_only)
    systematic = len(counts) >= 2 and negative == len(counts) and p_value <= alpha
    return ShiftTest(systematic, p_value, negative, len(counts), canary_only, baseline_only)


def profile(buckets: Sequence[Bucket], alpha: float) -> Profile:
    """The profile of `buckets` (shortest first): AUC per side and the systematic-shift test at level `alpha`."""
    lengths = [bucket.length for bucket in buckets]
    scored = all(bucket.counts.total for bucket in buckets)
    canary_auc = auc(lengths, [b.counts.canary_score for b in buckets]) if scored else None
    baseline_auc = auc(lengths, [b.counts.baseline_score for b in buckets]) if scored else None
    return Profile(tuple(buckets), canary_auc, baseline_auc, shift_test([b.counts for b in buckets], alpha))
