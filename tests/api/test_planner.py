"""The planner: a table row per rule and edge, property tests over generated specs, and the `kvpolicy plan` CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy.api.exit_codes import EXIT_USAGE
from kvpolicy.api.v1alpha1 import GpuFacts, GpuGeneration, KVCacheDtype, KVPolicySpec
from kvpolicy.planning import cli as plan_cli
from kvpolicy.planning.gpu import KNOWN_PRODUCTS, gpu_facts
from kvpolicy.planning.planner import plan

ROOT = Path(__file__).resolve().parents[2]
PATCHED = "registry.example/vllm-fp8-twolevel:1"

BASE: dict[str, Any] = {
    "targetRef": {"name": "llm"},
    "model": {"servedModelName": "m", "headDim": 128, "numLayers": 32, "maxModelLen": 131072},
    "workload": {"maxContextTokens": 131072, "typicalContextTokens": 32768},
    "images": {"fp8Patched": PATCHED},
}


def spec_with(**changes: Any) -> KVPolicySpec:
    """BASE with dotted-path changes, e.g. spec_with(**{"kvCache.dtype": "BF16"})."""
    data = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return KVPolicySpec.model_validate(data)


def gpu(name: str) -> GpuFacts:
    if name == "unknown":
        return gpu_facts([{"nvidia.com/gpu.product": "Mystery"}])
    return gpu_facts([KNOWN_PRODUCTS[name]])


# (id, GPU, spec changes, expected dtype, codes that must appear, expected --attention-backend or None)
ROWS: list[tuple[str, str, dict[str, Any], KVCacheDtype, set[str], str | None]] = [
    ("hopper-patched", "H100", {}, KVCacheDtype.FP8, {"TwoLevelAccumulationImage", "CanaryFP8"}, "FLASH_ATTN"),
    ("h200-patched", "H200", {}, KVCacheDtype.FP8, {"TwoLevelAccumulationImage"}, "FLASH_ATTN"),
    ("hopper-no-image", "H100", {"images.fp8Patched": None}, KVCacheDtype.BF16, {"NoTwoLevelImage", "HoldBF16"}, None),
    (
        "hopper-image-without-fix",
        "H100",
        {"images.fp8PatchedFeatures": ["FastHeadDim256"]},
        KVCacheDtype.BF16,
        {"NoTwoLevelImage"},
        None,
    ),
    (
        "hopper-explicit-fp8-no-image",
        "H100",
        {"images.fp8Patched": None, "kvCache.dtype": "FP8"},
        KVCacheDtype.BF16,
        {"NoTwoLevelImage", "FP8Refused"},
        None,
    ),
    ("blackwell", "B200", {"images.fp8Patched": None}, KVCacheDtype.FP8, {"BlackwellNoFixNeeded"}, "FLASHINFER"),
    ("gb200", "GB200", {}, KVCacheDtype.FP8, {"BlackwellNoFixNeeded"}, "FLASHINFER"),
    ("ampere-auto", "A100", {}, KVCacheDtype.BF16, {"NoFP8TensorCores"}, None),
    # TRITON_ATTN refuses an FP8 KV cache below compute capability 8.9: FlashInfer runs it on Ampere.
    ("ampere-explicit-fp8", "A100", {"kvCache.dtype": "FP8"}, KVCacheDtype.FP8, {"FP8Requested"}, "FLASHINFER"),
    (
        "ampere-explicit-fp8-head-dim-96",
        "A100",
        {"kvCache.dtype": "FP8", "model.headDim": 96},
        KVCacheDtype.BF16,
        {"NoFP8AttentionBackend", "FP8Refused"},
        None,
    ),
    ("ada-patched", "L40S", {}, KVCacheDtype.FP8, {"TwoLevelAccumulationImage"}, "TRITON_ATTN"),
    ("ada-no-image", "L40S", {"images.fp8Patched": None}, KVCacheDtype.BF16, {"NoTwoLevelImage"}, None),
    ("unknown-gpu", "unknown", {}, KVCacheDtype.BF16, {"UnknownGPU"}, None),
    ("unknown-gpu-explicit-fp8", "unknown", {"kvCache.dtype": "FP8"}, KVCacheDtype.BF16, {"FP8Refused"}, None),
    (
        "short-context-hopper",
        "H100",
        {"workload.typicalContextTokens": 2048},
        KVCacheDtype.BF16,
        {"BelowDecodeBreakEven"},
        None,
    ),
    (
        "short-context-blackwell-above-4k",
        "B200",
        {"workload.typicalContextTokens": 5000},
        KVCacheDtype.FP8,
        {"AboveDecodeBreakEven"},
        "FLASHINFER",
    ),
    (
        "short-context-explicit-fp8",
        "H100",
        {"workload.typicalContextTokens": 2048, "kvCache.dtype": "FP8"},
        KVCacheDtype.FP8,
        {"BelowDecodeBreakEven", "FP8Requested"},
        "FLASH_ATTN",
    ),
    (
        "own-break-even",
        "H100",
        {"workload.typicalContextTokens": 5000, "workload.decodeBreakEvenTokens": 4096},
        KVCacheDtype.FP8,
        {"AboveDecodeBreakEven"},
        "FLASH_ATTN",
    ),
    (
        "head-dim-256-prefill-critical",
        "H100",
        {"model.headDim": 256, "workload.prefillLatencyCritical": True},
        KVCacheDtype.BF16,
        {"HeadDim256PrefillPenalty"},
        None,
    ),
    (
        "head-dim-256-fast-path",
        "H100",
        {
            "model.headDim": 256,
            "workload.prefillLatencyCritical": True,
            "images.fp8PatchedFeatures": ["TwoLevelAccumulation", "FastHeadDim256"],
        },
        KVCacheDtype.FP8,
        {"FastHeadDim256Path"},
        "FLASH_ATTN",
    ),
    ("head-dim-256-not-critical", "H100", {"model.headDim": 256}, KVCacheDtype.FP8, {"HeadDim256PrefillCost"}, None),
    (
        "head-dim-256-blackwell",
        "B200",
        {"model.headDim": 256, "workload.prefillLatencyCritical": True},
        KVCacheDtype.FP8,
        {"BlackwellNoFixNeeded"},
        "FLASHINFER",
    ),
    ("explicit-bf16-overrides", "B200", {"kvCache.dtype": "BF16"}, KVCacheDtype.BF16, {"BF16Requested"}, None),
    ("mla-uncalibrated", "H100", {"model.attention": "MLA"}, KVCacheDtype.BF16, {"MLARequiresCalibratedScales"}, None),
    (
        "mla-uncalibrated-explicit-fp8",
        "B200",
        {"model.attention": "MLA", "kvCache.dtype": "FP8"},
        KVCacheDtype.BF16,
        {"FP8Refused"},
        None,
    ),
    (
        "mla-calibrated-hopper",
        "H200",
        {"model.attention": "MLA", "kvCache.scales": "Calibrated", "kvCache.scalesSource": "hf://x"},
        KVCacheDtype.FP8,
        {"CalibratedScales"},
        "FLASHMLA",
    ),
    # FlashMLA runs on compute capability 9.x and 10.x only: on Ada the MLA canary gets TRITON_MLA.
    (
        "mla-calibrated-ada",
        "L40S",
        {"model.attention": "MLA", "kvCache.scales": "Calibrated", "kvCache.scalesSource": "hf://x"},
        KVCacheDtype.FP8,
        {"CalibratedScales", "CanaryFP8"},
        "TRITON_MLA",
    ),
    (
        "mla-calibrated-ampere-explicit-fp8",
        "A100",
        {
            "model.attention": "MLA",
            "kvCache.scales": "Calibrated",
            "kvCache.scalesSource": "hf://x",
            "kvCache.dtype": "FP8",
        },
        KVCacheDtype.BF16,
        {"NoFP8AttentionBackend", "FP8Refused"},
        None,
    ),
    (
        "mla-calibrated-rtx-pro-6000-blackwell",
        "RTX-PRO-6000",
        {"model.attention": "MLA", "kvCache.scales": "Calibrated", "kvCache.scalesSource": "hf://x"},
        KVCacheDtype.FP8,
        {"BlackwellNoFixNeeded"},
        "TRITON_MLA",
    ),
    (
        "hopper-head-dim-512-no-fa3",
        "H100",
        {"model.headDim": 512},
        KVCacheDtype.BF16,
        {"NoFP8AttentionBackend"},
        None,
    ),
    (
        "mla-calibrated-blackwell",
        "B200",
        {"model.attention": "MLA", "kvCache.scales": "Calibrated", "kvCache.scalesSource": "hf://x"},
        KVCacheDtype.FP8,
        {"CalibratedScales"},
        "FLASHINFER_MLA",
    ),
    (
        "many-small-sliding-window-layers",
        "H100",
        {"model.slidingWindow": {"count": 12, "windowTokens": 128}, "model.numLayers": 24},
        KVCacheDtype.FP8,
        {"SkipSlidingWindowLayers"},
        "FLASH_ATTN",
    ),
    (
        "few-sliding-window-layers",
        "H100",
        {"model.slidingWindow": {"layers": [0, 1], "windowTokens": 128}},
        KVCacheDtype.FP8,
        {"SlidingWindowLayersFP8"},
        "FLASH_ATTN",
    ),
    (
        "sliding-window-never",
        "H100",
        {"model.slidingWindow": {"count": 16, "windowTokens": 128}, "kvCache.skipSlidingWindowLayers": "Never"},
        KVCacheDtype.FP8,
        set(),
        "FLASH_ATTN",
    ),
    (
        "sliding-window-always",
        "H100",
        {"model.slidingWindow": {"count": 1, "windowTokens": 32768}, "kvCache.skipSlidingWindowLayers": "Always"},
        KVCacheDtype.FP8,
        {"SkipSlidingWindowLayers"},
        "FLASH_ATTN",
    ),
    (
        "accuracy-gate-off",
        "H100",
        {"gates.accuracy": {"enabled": False}},
        KVCacheDtype.FP8,
        {"AccuracyGateDisabled"},
        None,
    ),
]


@pytest.mark.parametrize(
    ("gpu_name", "changes", "dtype", "codes", "backend"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_rule_table(
    gpu_name: str, changes: dict[str, Any], dtype: KVCacheDtype, codes: set[str], backend: str | None
) -> None:
    result = plan(spec_with(**changes), gpu(gpu_name))
    assert result.kv_cache_dtype == dtype, [r.code for r in result.reasons]
    assert codes <= {r.code for r in result.reasons}
    if dtype == KVCacheDtype.FP8:
        assert result.extra_args[:2] == ["--kv-cache-dtype", "fp8"]
        if backend is not None:
            assert result.attention_backend == backend
            assert result.extra_args[-2:] == ["--attention-backend", backend]
    else:
        assert result.extra_args == [] and result.gates == []


def test_hopper_canary_uses_the_patched_image_and_blackwell_keeps_the_target_image() -> None:
    assert plan(spec_with(), gpu("H100")).image == PATCHED
    # The canary differs from the target only in what the plan changes: off Hopper/Ada that is the KV flags alone.
    assert plan(spec_with(**{"images.baseline": "vllm:1"}), gpu("B200")).image is None
    assert plan(spec_with(), gpu("B200")).image is None  # keep the target's current image


def test_skip_layers_reach_the_vllm_args() -> None:
    result = plan(spec_with(**{"model.slidingWindow": {"count": 12, "windowTokens": 128}}), gpu("H100"))
    assert result.skip_layers == ["sliding_window"]
    assert "--kv-cache-dtype-skip-layers" in result.extra_args


def test_gates_follow_the_spec() -> None:
    assert plan(spec_with(), gpu("H100")).gates == ["Accuracy", "Latency"]
    preflight = spec_with(**{"gates.gpuPreflight": {"enabled": True}})
    assert plan(preflight, gpu("H100")).gates == ["GpuPreflight", "Accuracy", "Latency"]
    assert plan(preflight, gpu("B200")).gates == ["Accuracy", "Latency"]  # no accumulation cliff to probe


def test_mixed_pool_warns_and_plans_for_the_worst() -> None:
    facts = gpu_facts([KNOWN_PRODUCTS["B200"], KNOWN_PRODUCTS["H100"]])
    result = plan(spec_with(**{"images.fp8Patched": None}), facts)
    assert result.kv_cache_dtype == KVCacheDtype.BF16
    assert {"MixedGPUGenerations", "NoTwoLevelImage"} <= {r.code for r in result.reasons}


# ------------------------------------------------------------------------------------------------ properties

GPUS = [gpu(name) for name in (*KNOWN_PRODUCTS, "unknown")] + [
    gpu_facts([KNOWN_PRODUCTS["B200"], KNOWN_PRODUCTS["H100"]]),
    gpu_facts([]),
]


@st.composite
def specs(draw: st.DrawFn) -> KVPolicySpec:
    max_len = draw(st.integers(1024, 1_048_576))
    max_ctx = draw(st.integers(1, max_len))
    layers = draw(st.integers(1, 128))
    sliding: dict[str, Any] | None = draw(
        st.one_of(
            st.none(),
            st.builds(lambda c, w: {"count": c, "windowTokens": w}, st.integers(1, layers), st.integers(1, 65536)),
        )
    )
    calibrated = draw(st.booleans())
    data: dict[str, Any] = {
        "targetRef": {"name": "t"},
        "model": {
            "servedModelName": "m",
            "headDim": draw(st.sampled_from([64, 96, 128, 192, 256, 576])),
            "numLayers": layers,
            "attention": draw(st.sampled_from(["MHA", "GQA", "MLA"])),
            "maxModelLen": max_len,
            **({"slidingWindow": sliding} if sliding else {}),
        },
        "workload": {
            "maxContextTokens": max_ctx,
            "typicalContextTokens": draw(st.integers(1, max_ctx)),
            "prefillLatencyCritical": draw(st.booleans()),
        },
        "kvCache": {
            "dtype": draw(st.sampled_from(["Auto", "FP8", "BF16"])),
            "skipSlidingWindowLayers": draw(st.sampled_from(["Auto", "Always", "Never"])),
            "scales": "Calibrated" if calibrated else "Uncalibrated",
            **({"scalesSource": "hf://s"} if calibrated else {}),
        },
        "images": draw(
            st.sampled_from(
                [
                    {},
                    {"fp8Patched": PATCHED},
                    {"fp8Patched": PATCHED, "fp8PatchedFeatures": []},
                    {"fp8Patched": PATCHED, "fp8PatchedFeatures": ["TwoLevelAccumulation", "FastHeadDim256"]},
                ]
            )
        ),
    }
    return KVPolicySpec.model_validate(data)


@settings(max_examples=300, deadline=None)
@given(spec=specs(), facts=st.sampled_from(GPUS))
def test_every_plan_is_explained_and_safe(spec: KVPolicySpec, facts: GpuFacts) -> None:
    result = plan(spec, facts)
    assert result.reasons, "every plan carries at least one reason"
    assert all(r.code[0].isupper() and " " not in r.code and r.message for r in result.reasons)
    if result.kv_cache_dtype == KVCacheDtype.FP8:
        assert facts.generation != GpuGeneration.UNKNOWN
        if facts.generation in (GpuGeneration.HOPPER, GpuGeneration.ADA):
            assert spec.images.fp8_patched is not None
            assert "TwoLevelAccumulation" in spec.images.fp8_patched_features
            assert result.image == spec.images.fp8_patched
        if spec.model.attention.value == "MLA":
            assert spec.kv_cache.scales.value == "Calibrated"
        assert spec.kv_cache.dtype != KVCacheDtype.BF16
    else:
        assert "--kv-cache-dtype" not in result.extra_args


@settings(max_examples=100, deadline=None)
@given(spec=specs())
def test_spec_round_trips_through_its_k8s_form(spec: KVPolicySpec) -> None:
    assert KVPolicySpec.model_validate(spec.to_k8s()) == spec


# ------------------------------------------------------------------------------------------------------ CLI

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# What each example must plan on each GPU (the README's table shows the same).
EXPECTED = {
    "llama-3.1-8b-h100-128k.yaml": {"H100": "FP8", "H200": "FP8", "B200": "FP8", "A100": "BF16", "L40S": "FP8"},
    "gpt-oss-20b-sliding-window.yaml": {"H100": "FP8", "H200": "FP8", "B200": "FP8", "A100": "BF16", "L40S": "FP8"},
    "gemma-head-dim-256-ttft.yaml": {"H100": "BF16", "H200": "BF16", "B200": "FP8", "A100": "BF16", "L40S": "BF16"},
    "short-context-chat.yaml": {"H100": "BF16", "H200": "BF16", "B200": "BF16", "A100": "BF16", "L40S": "BF16"},
    "deepseek-mla-calibrated.yaml": {"H100": "FP8", "H200": "FP8", "B200": "FP8", "A100": "BF16", "L40S": "FP8"},
}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("gpu_name", ["H100", "H200", "B200", "A100", "L40S"])
def test_plan_cli_on_examples(example: Path, gpu_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["-f", str(example), "--gpu", gpu_name, "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["kvCacheDtype"] == EXPECTED[example.name][gpu_name]
    assert out["plan"]["reasons"]


def test_plan_cli_text_output_lists_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["-f", str(EXAMPLES[0]), "--gpu", "h100"]) == 0
    text = capsys.readouterr().out
    assert "KV cache: FP8" in text and "reasons:" in text


def test_plan_cli_node_labels_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = tmp_path / "labels.yaml"
    labels.write_text(yaml.safe_dump([KNOWN_PRODUCTS["B200"], {"nvidia.com/gpu.product": "NVIDIA-H100-SXM-SHARED"}]))
    assert plan_cli.main(["-f", str(EXAMPLES[0]), "--node-labels", str(labels), "-o", "yaml"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["gpu"]["mixed"] is True and out["gpu"]["generation"] == "Hopper"


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("kind: Deployment\n", ["--gpu", "H100"], "is not a KVPolicy"),
        ("spec: [unclosed\n", ["--gpu", "H100"], "not valid YAML"),
        ("", ["--gpu", "H100"], "no KVPolicy found"),
        (None, ["--gpu", "TPU"], "unknown --gpu 'TPU'"),
        (
            "kind: KVPolicy\nmetadata: {name: bad}\nspec:\n  targetRef: {name: t}\n"
            "  model: {servedModelName: m, headDim: 128, numLayers: 2, maxModelLen: 100}\n"
            "  workload: {maxContextTokens: 200}\n",
            ["--gpu", "H100"],
            "workload.maxContextTokens must not exceed model.maxModelLen",
        ),
        (
            "kind: KVPolicy\nspec:\n  targetRef: {name: t}\n  workload: {maxContextTokens: 200}\n",
            ["--gpu", "H100"],
            "spec.model: Field required",
        ),
    ],
)
def test_plan_cli_bad_input(
    tmp_path: Path, content: str | None, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(content if content is not None else EXAMPLES[0].read_text())
    assert plan_cli.main(["-f", str(path), *args]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_plan_cli_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["-f", "/nonexistent/policy.yaml", "--gpu", "H100"]) == EXIT_USAGE
    assert "cannot read KVPolicy manifest /nonexistent/policy.yaml: No such file" in capsys.readouterr().err
