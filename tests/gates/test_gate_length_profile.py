"""The length profile's pure parts: bucket lengths, AUC, the sign test and the systematic-shift flag, against
hand-computed cases, and properties where they are cheap."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpolicy.gate_programs.length_profile import (
    Bucket,
    auc,
    bucket_lengths,
    profile,
    shift_test,
    sign_test_p,
)
from kvpolicy.gate_programs.stats import PairedCounts


def counts(baseline_only: int, canary_only: int, both: int = 10, neither: int = 0) -> PairedCounts:
    return PairedCounts(both=both, canary_only=canary_only, baseline_only=baseline_only, neither=neither)


def test_buckets_halve_the_longest_length() -> None:
    assert bucket_lengths(131072, 4) == (16384, 32768, 65536, 131072)
    assert bucket_lengths(5000, 3) == (1250, 2500, 5000)
    assert bucket_lengths(699, 1) == (699,)


@pytest.mark.parametrize(("longest", "buckets", "fragment"), [(4096, 0, "between 1 and 6"), (4096, 7, "1 and 6"),
                                                              (2, 3, "cannot be halved 2 times")])  # fmt: skip
def test_bucket_lengths_refuse_what_cannot_be_a_profile(longest: int, buckets: int, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        bucket_lengths(longest, buckets)


def test_auc_is_the_trapezoid_over_log_length_per_doubling() -> None:
    # Halving buckets: (1/2 + 1/2 + 0) / 2 ... i.e. (1.0/2 + 0.5 + 0.0/2) / 2 = 0.5.
    assert auc([1024, 2048, 4096], [1.0, 0.5, 0.0]) == pytest.approx(0.5)
    # Uneven spacing: one doubling at score 1 (area 1), two doublings falling 1 -> 0 (area 1), over 3 doublings.
    assert auc([1024, 2048, 8192], [1.0, 1.0, 0.0]) == pytest.approx(2 / 3)
    assert auc([1000, 8000], [0.2, 0.6]) == pytest.approx(0.4)
    assert auc([4096], [0.7]) == 0.7


@pytest.mark.parametrize(
    ("lengths", "scores", "fragment"),
    [([], [], "at least one"), ([1024, 2048], [1.0], "one score per length"), ([2048, 1024], [1, 1], "increasing")],
)
def test_auc_refuses_bad_input(lengths: list[int], scores: list[float], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        auc(lengths, scores)


def test_sign_test_matches_the_binomial_tail_by_hand() -> None:
    assert sign_test_p(5, 0) == 1 / 32
    assert sign_test_p(3, 1) == (4 + 1) / 16  # C(4,3) + C(4,4) over 2^4
    assert sign_test_p(2, 2) == (6 + 4 + 1) / 16
    assert sign_test_p(0, 3) == 1.0
    assert sign_test_p(0, 0) == 1.0
    # Thousands of needles: exact integers, no overflow.
    assert 0 < sign_test_p(2600, 2400) < 0.003


def test_sign_test_refuses_negative_counts() -> None:
    with pytest.raises(ValueError, match="negative"):
        sign_test_p(-1, 2)


def test_a_loss_in_every_bucket_shown_by_the_pooled_sign_test_is_systematic() -> None:
    # 2 + 2 + 1 baseline-only, no canary-only: p = 2^-5 = 0.031 <= 0.05, and every bucket is below.
    test = shift_test([counts(2, 0), counts(2, 0), counts(1, 0)], alpha=0.05)
    assert test.systematic
    assert test.p_value == 1 / 32
    assert (test.negative_buckets, test.buckets, test.baseline_only, test.canary_only) == (3, 3, 5, 0)


def test_too_few_discordant_needles_are_not_shown() -> None:
    # Every bucket below, but 4 needles: p = 1/16 > 0.05.
    test = shift_test([counts(2, 0), counts(1, 0), counts(1, 0)], alpha=0.05)
    assert not test.systematic
    assert test.p_value == 1 / 16


def test_one_bucket_not_below_is_no_systematic_shift_however_large_the_loss() -> None:
    # A loss at the long end only: the max-length decision judges that, it is not a shift at every length.
    test = shift_test([counts(1, 1), counts(5, 0), counts(30, 0)], alpha=0.05)
    assert test.p_value < 1e-9
    assert test.negative_buckets == 2
    assert not test.systematic


def test_one_bucket_is_no_profile() -> None:
    test = shift_test([counts(40, 0)], alpha=0.05)
    assert test.p_value < 1e-9
    assert not test.systematic


def test_shift_test_refuses_a_bad_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        shift_test([counts(1, 0), counts(1, 0)], alpha=1.0)


def test_profile_reports_auc_per_side_and_their_ratio() -> None:
    # Baseline 1.0 everywhere; canary 0.9 at 1k and 2k and 0.8 at 4k (10 needles each).
    buckets = [
        Bucket(1024, 2, counts(1, 0, both=9)),
        Bucket(2048, 2, counts(1, 0, both=9)),
        Bucket(4096, 2, counts(2, 0, both=8)),
    ]
    result = profile(buckets, alpha=0.05)
    assert result.baseline_auc == pytest.approx(1.0)
    assert result.canary_auc == pytest.approx((0.9 / 2 + 0.9 + 0.8 / 2) / 2)
    assert result.auc_recovery == pytest.approx(0.875)
    # Below in every bucket, but 1 + 1 + 2 = 4 baseline-only needles: p = 1/16, not shown at 0.05.
    assert result.shift.p_value == 1 / 16
    assert not result.shift.systematic
    assert profile(buckets, alpha=0.1).shift.systematic


def test_a_bucket_without_needles_has_no_auc() -> None:
    result = profile([Bucket(1024, 0, PairedCounts()), Bucket(2048, 1, counts(0, 0))], alpha=0.05)
    assert result.canary_auc is None
    assert result.auc_recovery is None
    assert not result.shift.systematic


paired = st.builds(
    PairedCounts,
    both=st.integers(0, 50),
    canary_only=st.integers(0, 20),
    baseline_only=st.integers(0, 20),
    neither=st.integers(0, 20),
)


@given(st.integers(0, 60), st.integers(0, 60))
def test_sign_test_is_a_probability_that_falls_as_the_baseline_wins_more(baseline_only: int, canary_only: int) -> None:
    p = sign_test_p(baseline_only, canary_only)
    assert 0 < p <= 1
    assert sign_test_p(baseline_only + 1, canary_only) <= p
    assert sign_test_p(baseline_only, canary_only + 1) >= p


@given(st.lists(st.floats(0, 1), min_size=1, max_size=6))
def test_auc_lies_between_the_lowest_and_highest_score(scores: list[float]) -> None:
    lengths = bucket_lengths(131072, len(scores))
    area = auc(lengths, scores)
    assert min(scores) - 1e-12 <= area <= max(scores) + 1e-12
    assert math.isclose(auc(lengths, [scores[0]] * len(scores)), scores[0])


@given(st.lists(paired, min_size=2, max_size=6))
def test_canary_and_baseline_are_never_both_systematically_below(buckets: list[PairedCounts]) -> None:
    swapped = [
        PairedCounts(both=c.both, canary_only=c.baseline_only, baseline_only=c.canary_only, neither=c.neither)
        for c in buckets
    ]
    assert not (shift_test(buckets, 0.05).systematic and shift_test(swapped, 0.05).systematic)
    flagged = shift_test(buckets, 0.05)
    if flagged.systematic:
        assert all(c.canary_score < c.baseline_score for c in buckets)
        assert flagged.p_value <= 0.05
