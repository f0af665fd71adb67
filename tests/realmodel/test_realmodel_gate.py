"""The accuracy gate's three decisions on a real model's answers (`kvpolicy gate accuracy`, the command the gate Job
runs, against real vLLM serving SmolLM2-135M-Instruct), at the workload's length: 8,000 tokens of the model's 8,192.
The gate runs with the CRD's defaults (task, stopping rule, confidence, sample cap) unless a test says otherwise.

- A canary whose every layer sees only the last WINDOW tokens fails at 8,000 tokens and passes at a length inside the
  window, in the same test: broken in a way short prompts cannot see.
- The FP8-KV canary: the gate ends by its rules (a decision, Inconclusive because the baseline is too weak, or
  Inconclusive at its sample cap with the interval still straddling minRecovery), whatever the truth on this model.
- A/A: the baseline judged against itself passes within the gate's sample cap. Last: it takes the most samples (this
  model finds about 2.8 of a haystack's 8 needles at 8k: ~24 samples, BENCHMARKS.md).
"""

from __future__ import annotations

import pytest
from kvpolicy.api.reasons import GateReason
from kvpolicy.api.v1alpha1 import AccuracyGate
from realmodel_helpers import SHORT_LENGTH, WINDOW, WORKLOAD_LENGTH, GateRun, RealModelServers, run_accuracy_gate

# Each decision here takes tens of prompts on the real model (minutes each on 2 CPU cores): `make test-realmodel`.
pytestmark = [pytest.mark.realvllm, pytest.mark.realmodel, pytest.mark.longgate]

MIN_RECOVERY = float(AccuracyGate().min_recovery)
SAMPLE_CAP = AccuracyGate().max_samples
# The FP8 canary's run is capped lower: an Inconclusive at the cap is one of its lawful ends, and this bounds its time.
FP8_SAMPLE_CAP = 20


def describe(run: GateRun) -> str:
    return f"{run.report}\n{run.log[-4000:]}"


def judged(run: GateRun) -> bool:
    """A pass or a fail stands on a baseline at or above the gate's floor."""
    return bool(run.report["baselineScore"] >= run.report["baselineFloor"])


def test_a_canary_blind_beyond_its_window_fails_long_and_passes_short(real_model_servers: RealModelServers) -> None:
    windowed, baseline = real_model_servers.windowed.url, real_model_servers.baseline.url
    long = run_accuracy_gate(f"{WINDOW}-token window canary", windowed, baseline, WORKLOAD_LENGTH)
    fail = ("Fail", GateReason.RECOVERY_BELOW_THRESHOLD)
    assert (long.report["verdict"], long.report["reason"]) == fail, describe(long)
    assert long.report["recoveryHigh"] < MIN_RECOVERY and judged(long), describe(long)
    assert long.report["canaryScore"] < long.report["baselineScore"], describe(long)
    # Inside the window the canary attends to everything the baseline does.
    assert SHORT_LENGTH < WINDOW
    short = run_accuracy_gate(f"{WINDOW}-token window canary", windowed, baseline, SHORT_LENGTH)
    assert short.report["verdict"] == "Pass", describe(short)
    assert short.report["recoveryLow"] >= MIN_RECOVERY and judged(short), describe(short)


def test_the_fp8_kv_canary_ends_by_the_gates_rules(real_model_servers: RealModelServers) -> None:
    fp8, baseline = real_model_servers.fp8.url, real_model_servers.baseline.url
    run = run_accuracy_gate("FP8-KV canary", fp8, baseline, WORKLOAD_LENGTH, "--max-samples", str(FP8_SAMPLE_CAP))
    report = run.report
    low, high, verdict, reason = report["recoveryLow"], report["recoveryHigh"], report["verdict"], report["reason"]
    if verdict == "Pass":
        assert low >= MIN_RECOVERY and judged(run), describe(run)
    elif verdict == "Fail":
        assert (reason, high < MIN_RECOVERY, judged(run)) == (GateReason.RECOVERY_BELOW_THRESHOLD, True, True)
    elif reason == GateReason.BASELINE_TOO_WEAK:
        assert (verdict, judged(run)) == ("Inconclusive", False), describe(run)
    else:
        assert (verdict, reason, report["samples"]) == ("Inconclusive", GateReason.SAMPLE_CAP_REACHED, FP8_SAMPLE_CAP)
        assert low < MIN_RECOVERY <= high, describe(run)


def test_the_baseline_against_itself_passes_at_the_workload_length(real_model_servers: RealModelServers) -> None:
    baseline = real_model_servers.baseline.url
    run = run_accuracy_gate("A/A (the baseline against itself)", baseline, baseline, WORKLOAD_LENGTH)
    report = run.report
    assert (report["verdict"], report["lengthTokens"]) == ("Pass", WORKLOAD_LENGTH), describe(run)
    assert report["samples"] <= SAMPLE_CAP and judged(run), describe(run)
