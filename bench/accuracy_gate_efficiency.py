"""The accuracy gate's stopping rule over many seeded runs: prompts per decision and false decisions.

Each run feeds `kvpolicy.gates.accuracy.sequential_decision` (the gate's own rule, with the CRD's defaults unless a flag
says otherwise) paired needle outcomes drawn from a model of canary and baseline, one prompt of `--asked` needles at a
time, until it decides or reaches the cap. The baseline answers each needle right with probability `score`; the canary
keeps a baseline-right needle with probability `recovery` (so true recovery = `recovery`, and a baseline-wrong needle is
never canary-right). Loss shapes:
- independent: each needle lost on its own (what the simulator `kvpolicy sim` does);
- clustered: the canary loses all of a prompt's needles together with probability 1 - recovery (a canary that garbles
  whole answers; the gate assumes independent needles, this measures what it costs);
- noisy: independent, plus swaps both ways (2% of needles canary-only, as many more baseline-only), recovery unchanged
  (a real FP8 canary answering a few needles differently without being worse).
A false pass is a Pass with true recovery below minRecovery, a false fail a Fail with true recovery at or above it.
Recovery exactly at minRecovery (0.95) is the tests' boundary: there any Pass is wrong, and the rule's error bound
(1 - confidence, at any stopping time) is what holds it.

The --peeking table shows why the rule is a test by betting: a one-sided z-test of mean(X) > 0 at the same 95%,
looked at after every prompt as the gate does, against the rule, on the same outcome streams.

Run: .venv/bin/python bench/accuracy_gate_efficiency.py [--runs 1000] [--asked 4 8] [--floor-scan] [--stake-caps]
    [--peeking]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from kvpolicy.api.reasons import GateReason
from kvpolicy.gates import stats
from kvpolicy.gates.accuracy import AccuracyOptions, sequential_decision
from kvpolicy.gates.stats import Evidence

SCORES = (0.3, 0.5, 0.7, 0.95)
RECOVERIES = (1.0, 0.97, 0.95, 0.9, 0.8, 0.5, 0.0)
SWAP = 0.02


@dataclass(frozen=True)
class Scenario:
    score: float
    recovery: float
    shape: str = "independent"


def prompt_outcomes(scenario: Scenario, asked: int, rng: random.Random) -> Iterator[tuple[bool, bool]]:
    """(canary right, baseline right) for each needle of one prompt."""
    garbled = scenario.shape == "clustered" and rng.random() >= scenario.recovery
    for _ in range(asked):
        baseline = rng.random() < scenario.score
        if scenario.shape == "clustered":
            canary = baseline and not garbled
        else:
            canary = baseline and rng.random() < scenario.recovery
        if scenario.shape == "noisy":
            swap = rng.random()
            if not baseline and swap < SWAP / (1 - scenario.score):
                canary = True
            elif canary and swap < SWAP / (scenario.score * scenario.recovery):
                canary = False
        yield canary, baseline


def run_gate(scenario: Scenario, options: AccuracyOptions, seed: int) -> tuple[GateReason, int]:
    rng = random.Random(f"{scenario}:{options.asked}:{seed}")
    evidence = Evidence.start(options.min_recovery, options.baseline_floor, bounds=False)
    samples = 0
    while True:
        samples += 1
        for canary, baseline in prompt_outcomes(scenario, options.asked, rng):
            evidence = evidence.add(canary, baseline)
        reason = sequential_decision(evidence, samples, options)
        if reason is not None:
            return reason, samples


@dataclass(frozen=True)
class Tally:
    passes: int
    fails: int
    inconclusive: int
    weak: int
    mean: float
    p90: int
    largest: int

    @classmethod
    def of(cls, outcomes: list[tuple[GateReason, int]]) -> Tally:
        prompts = sorted(samples for _, samples in outcomes)
        count = {reason: sum(r == reason for r, _ in outcomes) for reason in GateReason}
        return cls(
            passes=count[GateReason.RECOVERY_ABOVE_THRESHOLD],
            fails=count[GateReason.RECOVERY_BELOW_THRESHOLD],
            inconclusive=count[GateReason.SAMPLE_CAP_REACHED],
            weak=count[GateReason.BASELINE_TOO_WEAK],
            mean=statistics.mean(prompts),
            p90=prompts[int(0.9 * (len(prompts) - 1))],
            largest=prompts[-1],
        )


def decision_rows(scenarios: list[Scenario], options: AccuracyOptions, runs: int) -> list[str]:
    rows = [
        f"| asked | shape | baseline score | true recovery | Pass / Fail / cap / too weak (of {runs}) "
        "| prompts: mean / p90 / max | false pass | false fail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario in scenarios:
        tally = Tally.of([run_gate(scenario, options, seed) for seed in range(runs)])
        false_pass = tally.passes if scenario.recovery < options.min_recovery else 0
        false_fail = tally.fails if scenario.recovery >= options.min_recovery else 0
        rows.append(
            f"| {options.asked} | {scenario.shape} | {scenario.score} | {scenario.recovery} "
            f"| {tally.passes} / {tally.fails} / {tally.inconclusive} / {tally.weak} "
            f"| {tally.mean:.1f} / {tally.p90} / {tally.largest} | {false_pass / runs:.2%} | {false_fail / runs:.2%} |"
        )
    return rows


def scenarios_for(shapes: tuple[str, ...]) -> list[Scenario]:
    grid = [Scenario(score, recovery) for score in SCORES for recovery in RECOVERIES]
    # The other shapes where they can mislead: at and near the bar, and A/A.
    near = (1.0, 0.97, 0.95, 0.9)
    extra = [Scenario(score, recovery, shape) for shape in shapes for score in (0.5, 0.95) for recovery in near]
    return grid + extra


def floor_rows(options: AccuracyOptions, runs: int) -> list[str]:
    """An identical A/A run at low baseline scores, with no floor: how often it still passes within the cap."""
    rows = [
        f"| asked | baseline score | A/A Pass within {options.max_samples} prompts (of {runs}) | prompts: mean / p90 |",
        "|---|---|---|---|",
    ]
    unfloored = replace(options, baseline_floor=0.0)
    for score in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3):
        tally = Tally.of([run_gate(Scenario(score, 1.0), unfloored, seed) for seed in range(runs)])
        rows.append(f"| {options.asked} | {score} | {tally.passes} | {tally.mean:.1f} / {tally.p90} |")
    return rows


def stake_cap_rows(options: AccuracyOptions, runs: int) -> list[str]:
    """The rule with other stake caps (stats.STAKE_CAP), at baseline 0.5, on the scenarios that set it."""
    scenarios = [Scenario(0.5, recovery) for recovery in (1.0, 0.97, 0.9, 0.8, 0.0)] + [Scenario(0.5, 1.0, "noisy")]
    header = " | ".join(f"{s.shape} {s.recovery}: P/F/cap, mean prompts" for s in scenarios)
    rows = [f"| asked | stake cap | {header} |", "|---|---|" + "---|" * len(scenarios)]
    chosen = stats.STAKE_CAP
    for cap in (0.5, 0.75, 0.9, 0.95):
        stats.STAKE_CAP = cap
        cells = []
        for scenario in scenarios:
            tally = Tally.of([run_gate(scenario, options, seed) for seed in range(runs)])
            cells.append(f"{tally.passes}/{tally.fails}/{tally.inconclusive}, {tally.mean:.1f}")
        rows.append(f"| {options.asked} | {cap} | {' | '.join(cells)} |")
    stats.STAKE_CAP = chosen
    return rows


def run_peeking_z_test(scenario: Scenario, options: AccuracyOptions, seed: int) -> tuple[GateReason, int]:
    """The naive alternative: z = mean / standard error of X = canary - bar * baseline after each prompt."""
    rng = random.Random(f"{scenario}:{options.asked}:{seed}")
    count, total, squares = 0, 0.0, 0.0
    critical = statistics.NormalDist().inv_cdf(options.confidence)
    for samples in range(1, options.max_samples + 1):
        for canary, baseline in prompt_outcomes(scenario, options.asked, rng):
            x = float(canary) - options.min_recovery * float(baseline)
            count, total, squares = count + 1, total + x, squares + x * x
        mean = total / count
        spread = math.sqrt(max(squares / count - mean * mean, 0.0) / count)
        if samples >= options.min_samples and spread > 0:
            if mean / spread > critical:
                return GateReason.RECOVERY_ABOVE_THRESHOLD, samples
            if mean / spread < -critical:
                return GateReason.RECOVERY_BELOW_THRESHOLD, samples
    return GateReason.SAMPLE_CAP_REACHED, options.max_samples


def peeking_rows(options: AccuracyOptions, runs: int) -> list[str]:
    rows = [
        f"| asked | baseline score | true recovery | z-test peeked each prompt: Pass / Fail / cap (of {runs}), mean "
        "prompts | the rule: Pass / Fail / cap, mean prompts |",
        "|---|---|---|---|---|",
    ]
    for recovery in (1.0, 0.97, 0.95, 0.9, 0.8):
        scenario = Scenario(0.5, recovery)
        cells = []
        for rule in (run_peeking_z_test, run_gate):
            tally = Tally.of([rule(scenario, options, seed) for seed in range(runs)])
            cells.append(f"{tally.passes} / {tally.fails} / {tally.inconclusive}, {tally.mean:.1f}")
        rows.append(f"| {options.asked} | 0.5 | {recovery} | {cells[0]} | {cells[1]} |")
    return rows


def needles_to_decide(min_recovery: float, confidence: float, canary: bool) -> int:
    """Needles, all right for the baseline and all right (or all wrong) for the canary, until the rule decides."""
    evidence, alpha = Evidence.start(min_recovery, 0.0, bounds=False), 1 - confidence
    while not (evidence.above_bar(alpha) if canary else evidence.below_bar(alpha)):
        evidence = evidence.add(canary, True)
    return evidence.counts.total


def needle_count_rows() -> list[str]:
    rows = [
        "| minRecovery | confidence | identical A/A: both-right needles to Pass | the least any valid test needs "
        "| canary losing all: needles to Fail |",
        "|---|---|---|---|---|",
    ]
    for min_recovery in (0.95, 0.9, 0.8):
        for confidence in (0.95, 0.9):
            fewest = math.log(1 / (1 - confidence)) / -math.log(min_recovery)
            rows.append(
                f"| {min_recovery} | {confidence} | {needles_to_decide(min_recovery, confidence, True)} "
                f"| {fewest:.0f} | {needles_to_decide(min_recovery, confidence, False)} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="seeded runs per scenario")
    parser.add_argument("--asked", type=int, nargs="+", default=[AccuracyOptions("", "", 1, "").asked])
    parser.add_argument("--shapes", nargs="*", default=["clustered", "noisy"], choices=["clustered", "noisy"])
    parser.add_argument("--floor-scan", action="store_true", help="also: A/A pass rate at low baseline scores")
    parser.add_argument("--stake-caps", action="store_true", help="also: the rule with other stake caps")
    parser.add_argument("--peeking", action="store_true", help="also: a z-test looked at after every prompt")
    parser.add_argument("--no-grid", action="store_true", help="skip the main table")
    args = parser.parse_args()
    defaults = AccuracyOptions(canary="", baseline="", length=1, model="")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"minRecovery {defaults.min_recovery}, confidence {defaults.confidence}, maxSamples {defaults.max_samples}, "
        f"baselineFloor {defaults.baseline_floor}, min samples {defaults.min_samples}"
    )
    print()
    print("\n".join(needle_count_rows()), end="\n\n", flush=True)
    started = time.perf_counter()
    for asked in args.asked:
        options = replace(defaults, asked=asked, needles=max(defaults.needles, asked))
        if not args.no_grid:
            rows = decision_rows(scenarios_for(tuple(args.shapes)), options, args.runs)
            print("\n".join(rows), end="\n\n", flush=True)
        if args.stake_caps:
            print("\n".join(stake_cap_rows(options, args.runs)), end="\n\n", flush=True)
        if args.peeking:
            print("\n".join(peeking_rows(options, args.runs)), end="\n\n", flush=True)
        if args.floor_scan:
            print("\n".join(floor_rows(options, args.runs)), end="\n\n", flush=True)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
