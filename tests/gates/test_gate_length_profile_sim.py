"""The accuracy gate's length profile against simulators over loopback HTTP: a canary a little worse at every length
passes and is flagged as a systematic shift; an H200 canary without two-level accumulation still fails at 128k; the
profile never changes the decision or the prompts it takes."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from gate_fakes import FAST, MODEL, run_gate
from kvpolicy.gate_programs.report import GateReport, read_report, render
from kvpolicy_dev.sim import start_simulator_subprocess

# The shift is flat in length, so a short profile shows it as well as a long one, in a fraction of the time.
SHIFT_LENGTH = 16384
SHIFT_BUCKETS = [2048, 4096, 8192, 16384]
BUCKETS = [16384, 32768, 65536, 131072]


@pytest.fixture(scope="module")
def canaries() -> Iterator[dict[str, str]]:
    configurations = {
        # Two-level accumulation, but KV scales of 1.0 that cost ~2% of needles at every length.
        "shifted": ["--kv-cache-dtype", "fp8", "--two-level-fix", "--kv-scale-error", "0.30"],
        "h200": ["--kv-cache-dtype", "fp8", "--gpu", "h200"],
    }
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(start_simulator_subprocess([MODEL, *FAST, *flags]))
            for name, flags in configurations.items()
        }


def gate(canary: str, baseline: str, tmp_path: Path, *extra: str, length: int = SHIFT_LENGTH) -> tuple[int, dict]:
    return run_gate("accuracy", canary, baseline, tmp_path, "--length", str(length), "--model", MODEL, *extra)


def test_a_small_shift_at_every_length_passes_and_is_flagged_systematic(
    canaries: dict[str, str], simulators: dict[str, str], tmp_path: Path
) -> None:
    code, result = gate(canaries["shifted"], simulators["bf16"], tmp_path, "--length-buckets", "4")
    assert (code, result["verdict"], result["reason"]) == (0, "Pass", "RecoveryAboveThreshold")
    profile = result["profile"]
    assert [bucket["lengthTokens"] for bucket in profile["buckets"]] == SHIFT_BUCKETS
    assert all(bucket["canaryScore"] < bucket["baselineScore"] for bucket in profile["buckets"])
    assert all(bucket["prompts"] == result["samples"] for bucket in profile["buckets"])
    assert profile["systematicShift"] is True
    assert profile["negativeBuckets"] == 4 and profile["shiftPValue"] <= 0.05
    assert profile["canaryAuc"] < profile["baselineAuc"]
    assert "systematic shift" in result["message"] and "calibrate the KV scales" in result["message"]
    # The longest bucket is the decision's own needles.
    longest = profile["buckets"][-1]
    assert (longest["canaryScore"], longest["baselineScore"]) == (result["canaryScore"], result["baselineScore"])


def test_the_profile_neither_changes_the_decision_nor_delays_it(
    canaries: dict[str, str], simulators: dict[str, str], tmp_path: Path
) -> None:
    _, alone = gate(canaries["shifted"], simulators["bf16"], tmp_path)
    _, profiled = gate(canaries["shifted"], simulators["bf16"], tmp_path, "--length-buckets", "4")
    assert "profile" not in alone
    keys = ("verdict", "reason", "samples", "canaryScore", "baselineScore", "recovery", "recoveryLow", "recoveryHigh")
    assert {key: profiled[key] for key in keys} == {key: alone[key] for key in keys}


def test_an_h200_canary_without_two_level_accumulation_still_fails_at_128k(
    canaries: dict[str, str], simulators: dict[str, str], tmp_path: Path
) -> None:
    code, result = gate(canaries["h200"], simulators["bf16"], tmp_path, "--length-buckets", "4", length=131072)
    assert (code, result["verdict"], result["reason"]) == (1, "Fail", "RecoveryBelowThreshold")
    assert result["recoveryHigh"] < 0.95
    # The loss grows with length: the shortest bucket keeps the baseline's needles, the longest loses most.
    buckets = result["profile"]["buckets"]
    assert [bucket["lengthTokens"] for bucket in buckets] == BUCKETS
    assert buckets[-1]["recovery"] < 0.5 < buckets[0]["recovery"]


def test_an_identical_pair_is_not_flagged(simulators: dict[str, str], tmp_path: Path) -> None:
    code, result = gate(simulators["bf16"], simulators["bf16"], tmp_path, "--length-buckets", "4")
    assert (code, result["verdict"]) == (0, "Pass")
    assert result["profile"]["systematicShift"] is False
    assert result["profile"]["aucRecovery"] == 1.0
    assert "systematic shift" not in result["message"]


def test_a_shortest_bucket_too_short_for_the_needles_is_inconclusive_and_named(
    simulators: dict[str, str], tmp_path: Path
) -> None:
    code, result = run_gate(
        "accuracy", simulators["bf16"], simulators["bf16"], tmp_path,
        "--length", "1200", "--model", MODEL, "--length-buckets", "4",
    )  # fmt: skip
    assert (code, result["verdict"], result["reason"]) == (2, "Inconclusive", "LengthTooShort")
    assert "the length profile's shortest bucket, 150, leaves no room for haystack" in result["message"]


@pytest.mark.parametrize(
    ("buckets", "length", "fragment"),
    [("0", "4096", "--length-buckets must be between 1 and 6, got 0"), ("7", "4096", "between 1 and 6, got 7"),
     ("4", "4", "--length-buckets 4 halves --length 4 below one token")],
)  # fmt: skip
def test_bad_bucket_counts_are_usage_errors(buckets: str, length: str, fragment: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    completed = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "gate", "accuracy", "--canary", "http://127.0.0.1:1", "--baseline",
         "http://127.0.0.1:1", "--model", MODEL, "--length", length, "--length-buckets", buckets],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert completed.returncode == 64
    assert fragment in completed.stderr
    assert "Traceback" not in completed.stderr


def test_the_report_carries_the_profile_to_the_operator() -> None:
    document = {
        "gate": "accuracy",
        "verdict": "Pass",
        "reason": "RecoveryAboveThreshold",
        "profile": {
            "buckets": [
                {"lengthTokens": n, "prompts": 40, "needles": 320, "canaryScore": 0.9, "baselineScore": 0.92,
                 "recovery": 0.978, "canaryOnly": 0, "baselineOnly": 6}
                for n in BUCKETS
            ],
            "canaryAuc": 0.9, "baselineAuc": 0.92, "aucRecovery": 0.978, "systematicShift": True,
            "shiftPValue": 6e-8, "negativeBuckets": 4,
        },
    }  # fmt: skip
    report = read_report(render(GateReport.model_validate(document)))
    assert report.profile is not None and report.profile.systematic_shift
    assert [bucket.length_tokens for bucket in report.profile.buckets] == BUCKETS
    # Six buckets (the most) and a long message still fit the 4 KiB termination log: the message is cut, not the
    # profile.
    six = [{**document["profile"]["buckets"][0], "lengthTokens": 131072 >> k, "needles": 99999} for k in range(6)]
    document["profile"]["buckets"] = six
    long = GateReport.model_validate({**document, "message": "x" * 4000})
    text = render(long)
    assert len(text.encode()) <= 4096
    kept = read_report(text)
    assert kept.profile is not None and len(kept.profile.buckets) == 6 and kept.message.endswith("...")
