"""The accuracy gate's stopping rule (kvpolicy.gates.stats tests read by accuracy.sequential_decision), on paired
needle outcomes given directly: no servers."""

import math
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy.api.reasons import GateReason
from kvpolicy.gates.accuracy import AccuracyOptions, sequential_decision
from kvpolicy.gates.stats import STAKE_CAP, Evidence, PairedCounts

Pair = tuple[bool, bool]  # (canary right, baseline right)
OPTIONS = AccuracyOptions(canary="", baseline="", length=8192, model="m")


def decide(prompts: Iterable[Sequence[Pair]], options: AccuracyOptions = OPTIONS) -> tuple[GateReason | None, int]:
    """The first decision over these prompts and after how many; (None, prompts seen) if none came."""
    evidence = Evidence.start(options.min_recovery, options.baseline_floor)
    samples = 0
    for prompt in prompts:
        samples += 1
        for canary, baseline in prompt:
            evidence = evidence.add(canary, baseline)
        reason = sequential_decision(evidence, samples, options)
        if reason is not None:
            return reason, samples
    return None, samples


def identical(right: int, wrong: int) -> list[Pair]:
    """One prompt both sides answer alike: `right` needles right, `wrong` wrong."""
    return [(True, True)] * right + [(False, False)] * wrong


def test_an_identical_a_a_passes_once_enough_needles_are_right_on_both_sides() -> None:
    # Half the needles right on both sides, 4 asked per prompt: 2 both-right needles a prompt.
    reason, samples = decide([identical(2, 2)] * 100)
    assert reason == GateReason.RECOVERY_ABOVE_THRESHOLD
    alpha, bar = 1 - OPTIONS.confidence, OPTIONS.min_recovery
    # No valid test can pass sooner: had the canary lost 5% of the needles, seeing none lost would be this likely.
    fewest = math.log(1 / alpha) / -math.log(bar)
    # The stakes reach their cap at once for an A/A run, so it passes when the capped bets have grown 1/alpha.
    capped = math.log(1 / alpha) / math.log1p(STAKE_CAP * (1 - bar) / bar)
    assert fewest <= 2 * samples <= math.ceil(capped) + 2
    assert samples <= 40  # ~33 prompts at half the needles right, 4 asked


def test_a_canary_that_loses_every_needle_the_baseline_gets_fails_at_the_first_look() -> None:
    reason, samples = decide([[(False, True)] * 3 + [(False, False)]] * 10)
    assert (reason, samples) == (GateReason.RECOVERY_BELOW_THRESHOLD, OPTIONS.min_samples)


def test_no_decision_is_taken_before_min_samples() -> None:
    evidence = Evidence.start(OPTIONS.min_recovery, OPTIONS.baseline_floor)
    for _ in range(8):
        evidence = evidence.add(False, True)
    assert evidence.below_bar(0.05)
    assert sequential_decision(evidence, 1, OPTIONS) is None
    assert sequential_decision(evidence, 2, OPTIONS) == GateReason.RECOVERY_BELOW_THRESHOLD


def test_balanced_discordance_keeps_sampling_then_ends_at_the_cap() -> None:
    # Each prompt: the canary loses one needle and wins another; recovery 1.0 but too noisy to show above 0.95.
    mixed = [(True, True), (True, False), (False, True), (False, False)]
    assert decide([mixed] * 30) == (None, 30)
    reason, samples = decide([mixed] * 100)
    assert (reason, samples) == (GateReason.SAMPLE_CAP_REACHED, OPTIONS.max_samples)


def test_a_baseline_that_never_answers_is_too_weak_soon_never_a_pass_or_fail() -> None:
    reason, samples = decide([identical(0, 4)] * 100)
    assert reason == GateReason.BASELINE_TOO_WEAK
    assert samples <= 10


def test_a_broken_canary_against_a_baseline_below_the_floor_is_too_weak_not_a_fail() -> None:
    # The baseline gets 1 needle in 8 (below the 0.2 floor); the canary none.
    reason, _ = decide([[(False, True)] + [(False, False)] * 7] * 100)
    assert reason == GateReason.BASELINE_TOO_WEAK


def test_a_baseline_under_the_floor_at_the_cap_is_too_weak_not_sample_cap() -> None:
    options = AccuracyOptions(canary="", baseline="", length=8192, model="m", baseline_floor=0.6, max_samples=10)
    # Identical answers, baseline score 0.5: not shown below 0.6 in 10 prompts, but below it.
    assert decide([identical(2, 2)] * 10, options) == (GateReason.BASELINE_TOO_WEAK, 10)


def test_bounds_bracket_the_point_and_agree_with_the_decision() -> None:
    evidence = Evidence.start(OPTIONS.min_recovery, OPTIONS.baseline_floor)
    for _ in range(40):
        evidence = evidence.add(True, True).add(False, False)
    open_bounds = evidence.bounds(0.05)
    assert open_bounds.low < OPTIONS.min_recovery < 1.0 < open_bounds.high
    for _ in range(60):
        evidence = evidence.add(True, True)
    passed = evidence.bounds(0.05)
    assert evidence.above_bar(0.05) and passed.low >= OPTIONS.min_recovery and passed.point == 1.0
    assert passed.high > 1.0


def test_bounds_need_the_grid() -> None:
    with pytest.raises(ValueError, match="started without bounds"):
        Evidence.start(0.95, 0.2, bounds=False).bounds(0.05)


def test_pairing_counts_each_cell() -> None:
    counts = PairedCounts().add(True, True).add(True, False).add(False, True).add(False, False)
    assert (counts.both, counts.canary_only, counts.baseline_only, counts.neither) == (1, 1, 1, 1)
    assert counts.canary_score == counts.baseline_score == 0.5 and counts.recovery == 1.0
    assert PairedCounts(neither=3).recovery is None


prompts = st.lists(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=8), max_size=40)


@settings(max_examples=150, deadline=None)
@given(prompts=prompts, floor=st.sampled_from([0.0, 0.2, 0.5]), bar=st.sampled_from([0.8, 0.95, 0.953]))
def test_a_decision_always_agrees_with_the_scores_it_reports(
    prompts: list[list[Pair]], floor: float, bar: float
) -> None:
    options = AccuracyOptions(
        canary="", baseline="", length=8192, model="m", min_recovery=bar, baseline_floor=floor, max_samples=40
    )
    evidence = Evidence.start(bar, floor)
    for samples, prompt in enumerate(prompts, start=1):
        for canary, baseline in prompt:
            evidence = evidence.add(canary, baseline)
        reason = sequential_decision(evidence, samples, options)
        counts, bounds = evidence.counts, evidence.bounds(1 - options.confidence)
        if reason in (GateReason.RECOVERY_ABOVE_THRESHOLD, GateReason.RECOVERY_BELOW_THRESHOLD):
            assert counts.baseline_score >= floor and counts.recovery is not None
        if reason == GateReason.RECOVERY_ABOVE_THRESHOLD:
            assert counts.recovery >= options.min_recovery and bounds.low >= options.min_recovery
        if reason == GateReason.RECOVERY_BELOW_THRESHOLD:
            assert counts.recovery < options.min_recovery and bounds.high <= options.min_recovery
        if reason is not None:
            break


@settings(max_examples=100, deadline=None)
@given(prompts=prompts)
def test_a_canary_answering_better_never_fails_where_a_worse_one_passes(prompts: list[list[Pair]]) -> None:
    """Turning canary-wrong needles right can only help: the better canary's first decision is no Fail when the
    worse one passed."""
    better = [[(True, baseline) for _, baseline in prompt] for prompt in prompts]
    worse, _ = decide(prompts)
    if worse == GateReason.RECOVERY_ABOVE_THRESHOLD:
        assert decide(better)[0] != GateReason.RECOVERY_BELOW_THRESHOLD
