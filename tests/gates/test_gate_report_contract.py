"""The gate report contract: what every gate writes, the GPU probe's own writer included, the operator reads back as a
GateReport; anything else reads as a clear Inconclusive, never an exception."""

from __future__ import annotations

import json

import pytest
from kvkernels import probe
from kvpolicy.api.reasons import REPORT_PROBLEMS, GateReason
from kvpolicy.api.v1alpha1 import GateVerdict
from kvpolicy.gate_programs import report
from kvpolicy.gate_programs.report import GateReport, read_report


def _probe_report(safe: bool, lengths: int = 3) -> probe.ProbeReport:
    results = [probe.LengthResult(4096 * 2**i, -0.001, 1e-3, 1e-4, 1e-3) for i in range(lengths)]
    thresholds = probe.Thresholds()
    verdict = probe.judge(results, thresholds)
    if not safe:
        verdict = probe.Verdict(False, "at 8192 tokens the output changed by -5.00% in norm")
    return probe.ProbeReport(
        "triton", "kvkernels 0.1.0", "two-level", "H200", 128, 131072, thresholds, results, verdict, 1.5, ""
    )


@pytest.mark.parametrize(("safe", "verdict"), [(True, "Safe"), (False, "Unsafe")])
def test_the_probes_report_is_a_gate_report(safe: bool, verdict: str) -> None:
    document = _probe_report(safe).as_json()
    parsed = read_report(probe.termination_message(document))
    assert parsed.verdict == verdict and parsed.reason not in REPORT_PROBLEMS
    assert parsed.reason == (GateReason.ACCUMULATION_SAFE if safe else GateReason.ACCUMULATION_UNSAFE)
    assert parsed.message == document["message"] and "tokens" in parsed.message


def test_the_probes_shortened_reports_stay_gate_reports() -> None:
    document = _probe_report(True, lengths=200).as_json()
    document["note"] = "n" * 5000
    text = probe.termination_message(document)
    assert len(text.encode()) <= report.TERMINATION_LOG_LIMIT
    assert read_report(text).verdict == GateVerdict.SAFE
    huge = {**document, "message": "m" * 9000}
    shortest = probe.termination_message(huge)
    assert json.loads(shortest).keys() == {"verdict", "reason", "message"}
    assert read_report(shortest).verdict == GateVerdict.SAFE


def test_the_probes_could_not_run_report_is_inconclusive() -> None:
    parsed = read_report(json.dumps(probe.cannot_run_report("probe could not run: no CUDA device")))
    assert (parsed.verdict, parsed.reason) == (GateVerdict.INCONCLUSIVE, GateReason.PROBE_COULD_NOT_RUN)
    assert "no CUDA" in parsed.message


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, GateReason.REPORT_MISSING),
        ("  \n", GateReason.REPORT_MISSING),
        ("Traceback (most recent call last): boom", GateReason.REPORT_UNREADABLE),
        ('{"verdict": "Maybe", "message": "?"}', GateReason.REPORT_UNREADABLE),
        ('{"verdict": null, "error": "old probe"}', GateReason.REPORT_UNREADABLE),
        ('{"verdict": "Pass", "reason": "not a code"}', GateReason.REPORT_UNREADABLE),
        ('{"reason": "NoVerdict"}', GateReason.REPORT_UNREADABLE),
        ('{"verdict": "Pass", "message": "' + "x" * 5000 + '"}', GateReason.REPORT_TOO_LARGE),
    ],
)
def test_what_is_no_report_reads_as_a_clear_inconclusive(text: str | None, reason: GateReason) -> None:
    parsed = read_report(text)
    assert (parsed.verdict, parsed.reason) == (GateVerdict.INCONCLUSIVE, reason)
    assert parsed.message


def test_a_report_survives_emit_and_read_with_its_figures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(report.TERMINATION_LOG_ENV, raising=False)
    monkeypatch.setattr(report, "DEFAULT_TERMINATION_LOG", report.DEFAULT_TERMINATION_LOG.with_name("absent-log"))
    written = {"gate": "accuracy", "verdict": "Fail", "reason": "RecoveryBelowThreshold", "recovery": 0.5, "extra": 1}
    assert report.emit(written) == 1
    printed = capsys.readouterr().out
    parsed = read_report(f"some log line\n{printed}")
    assert parsed.verdict == GateVerdict.FAIL and parsed.recovery == 0.5
    assert json.loads(printed) == written


def test_emit_refuses_a_gate_result_that_is_no_report() -> None:
    with pytest.raises(ValueError, match="verdict"):
        report.emit({"gate": "accuracy", "verdict": "Maybe"})
    assert GateReport.problem(GateReason.REPORT_MISSING, "x").verdict == GateVerdict.INCONCLUSIVE
