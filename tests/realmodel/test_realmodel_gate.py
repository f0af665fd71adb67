"""The accuracy gate's three decisions on a real model's answers (`kvpolicy gate accuracy`, the command the gate Job
runs, against real vLLM serving SmolLM2-135M-Instruct), at the workload's length: 8,000 tokens of the model's 8,192.

- A/A: the baseline judged against itself passes, within a bounded number of prompts.
- A canary whose every layer sees only the last WINDOW tokens fails at 8,000 tokens and passes at a length inside the
  window, in the same test: broken in a way short prompts cannot see.
- The FP8-KV canary: the gate ends by its rules (a decision, or Inconclusive at its sample cap with the interval
  still straddling minRecovery), whatever the truth on this model.
"""

from __future__ import annotations

import pytest
from kvpolicy.api.reasons import GateReason
from realmodel_helpers import SHORT_LENGTH, WINDOW, WORKLOAD_LENGTH, GateRun, RealModelServers, run_accuracy_gate

pytestmark = [pytest.mark.realvllm, pytest.mark.realmodel]

# The most prompts a decision may take here (issue 21: an A/A should pass within 20 at 8k tokens).
PROMPT_BUDGET = 20
MIN_RECOVERY = 0.95
# The baseline must find needles for any verdict to mean something; SmolLM2-135M found 25-57% of them at 1.5k-8k
# tokens in this tier's runs (BENCHMARKS.md).
BASELINE_FLOOR = 0.1


def budget(*extra: str) -> tuple[str, ...]:
    return ("--max-samples", str(PROMPT_BUDGET), "--min-recovery", str(MIN_RECOVERY), *extra)


def describe(run: GateRun) -> str:
    return f"{run.report}\n{run.log[-4000:]}"


def test_the_baseline_against_itself_passes_at_the_workload_length(real_model_servers: RealModelServers) -> None:
    baseline = real_model_servers.baseline.url
    run = run_accuracy_gate("A/A (the baseline against itself)", baseline, baseline, WORKLOAD_LENGTH, *budget())
    report = run.report
    assert (report["verdict"], report["lengthTokens"]) == ("Pass", WORKLOAD_LENGTH), describe(run)
    assert report["samples"] <= PROMPT_BUDGET
    assert report["baselineScore"] >= BASELINE_FLOOR, describe(run)


def test_a_canary_blind_beyond_its_window_fails_long_and_passes_short(real_model_servers: RealModelServers) -> None:
    windowed, baseline = real_model_servers.windowed.url, real_model_servers.baseline.url
    long = run_accuracy_gate(f"{WINDOW}-token window canary", windowed, baseline, WORKLOAD_LENGTH, *budget())
    assert (long.report["verdict"], long.report["reason"]) == ("Fail", GateReason.RECOVERY_BELOW_THRESHOLD), describe(
        long
    )
    assert long.report["recoveryHigh"] < MIN_RECOVERY and long.report["baselineScore"] >= BASELINE_FLOOR
    assert long.report["canaryScore"] < long.report["baselineScore"], describe(long)
    # Inside the window the canary attends to everything the baseline does.
    assert SHORT_LENGTH < WINDOW
    short = run_accuracy_gate(f"{WINDOW}-token window canary", windowed, baseline, SHORT_LENGTH, *budget())
    assert short.report["verdict"] == "Pass", describe(short)
    assert short.report["recoveryLow"] >= MIN_RECOVERY and short.report["baselineScore"] >= BASELINE_FLOOR


def test_the_fp8_kv_canary_ends_by_the_gates_rules(real_model_servers: RealModelServers) -> None:
    fp8, baseline = real_model_servers.fp8.url, real_model_servers.baseline.url
    run = run_accuracy_gate("FP8-KV canary", fp8, baseline, WORKLOAD_LENGTH, *budget())
    report = run.report
    assert report["baselineScore"] >= BASELINE_FLOOR, describe(run)
    low, high = report["recoveryLow"], report["recoveryHigh"]
    assert low <= report["recovery"] <= high, describe(run)
    verdict = report["verdict"]
    if verdict == "Pass":
        assert low >= MIN_RECOVERY, describe(run)
    elif verdict == "Fail":
        assert (report["reason"], high < MIN_RECOVERY) == (GateReason.RECOVERY_BELOW_THRESHOLD, True), describe(run)
    else:
        assert verdict == "Inconclusive", describe(run)
        assert (report["reason"], report["samples"]) == (GateReason.SAMPLE_CAP_REACHED, PROMPT_BUDGET), describe(run)
        assert low < MIN_RECOVERY <= high, describe(run)
