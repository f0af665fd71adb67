"""The attention-backend table: a row per GPU and model shape, and the table against vLLM's own backend classes."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from kvpolicy.api.v1alpha1 import GpuGeneration
from kvpolicy.planning.attention import BACKENDS, GENERATION_CAPABILITIES, choose_backend
from kvpolicy.planning.gpu import FAMILY_LABEL, KNOWN_PRODUCTS, gpu_facts

# (GPU: a product name or {label: value}, MLA?, head_dim, the backend planned or None for "none runs FP8 there")
ROWS: list[tuple[str | dict[str, str], bool, int, str | None]] = [
    ("H100", False, 128, "FLASH_ATTN"),
    ("H200", False, 256, "FLASH_ATTN"),
    ("H100", False, 512, None),  # FlashAttention takes head sizes up to 256
    ("GH200", True, 576, "FLASHMLA"),
    ("H800", True, 576, "FLASHMLA"),
    ("B200", False, 128, "FLASHINFER"),
    ("B200", False, 96, "TRITON_ATTN"),  # FlashInfer: 64, 128, 256, 512 only
    ("B200", True, 576, "FLASHINFER_MLA"),
    ("B300", True, 576, "FLASHINFER_MLA"),
    ("RTX-PRO-6000", True, 576, "TRITON_MLA"),  # 12.0: no FlashInfer-MLA, no FlashMLA
    ("RTX-5090", False, 128, "FLASHINFER"),
    ("L40S", False, 128, "TRITON_ATTN"),
    ("L40S", True, 576, "TRITON_MLA"),  # the MLA-on-Ada case: FLASHMLA would crash-loop there
    ("L4", True, 576, "TRITON_MLA"),
    ("RTX-4090", False, 16, None),  # Triton attention takes head sizes from 32
    ("A100", False, 128, "FLASHINFER"),  # TRITON_ATTN refuses FP8 below 8.9
    ("A10", False, 256, "FLASHINFER"),
    ("A100", False, 96, None),
    ("A100", True, 576, None),  # no MLA backend runs FP8 below 8.9
    ("RTX-A6000", True, 576, None),
    # A family label only: the backend must run on every capability of the generation (Blackwell: 10.x to 12.x).
    ({FAMILY_LABEL: "blackwell"}, True, 576, "TRITON_MLA"),
    ({FAMILY_LABEL: "blackwell"}, False, 128, "FLASHINFER"),
    ({FAMILY_LABEL: "hopper"}, False, 128, "FLASH_ATTN"),
    ({FAMILY_LABEL: "ampere"}, True, 576, None),
]


def _labels(gpu: str | dict[str, str]) -> dict[str, str]:
    return KNOWN_PRODUCTS[gpu] if isinstance(gpu, str) else gpu


@pytest.mark.parametrize(("gpu", "mla", "head_dim", "expected"), ROWS, ids=[f"{r[0]}-{r[1]}-{r[2]}" for r in ROWS])
def test_backend_table(gpu: str | dict[str, str], mla: bool, head_dim: int, expected: str | None) -> None:
    facts = gpu_facts([_labels(gpu)])
    choice = choose_backend(facts.generation, facts.compute_capability, mla, head_dim)
    assert choice.backend == expected, choice.reason
    if expected is None:
        assert "no vLLM attention backend" in choice.reason


def test_a_refusal_names_each_backend_and_why() -> None:
    facts = gpu_facts([KNOWN_PRODUCTS["L40S"]])
    choice = choose_backend(facts.generation, facts.compute_capability, False, 16)
    assert choice.reason == (
        "no vLLM attention backend serves an FP8 KV cache for head_dim 16 on compute capability 8.9 "
        "(TRITON_ATTN: its FP8 KV cache needs native FP8 (compute capability 8.9 and above), not head_dim 16)"
    )


def test_every_known_gpu_gets_a_backend_for_a_common_shape_or_is_ampere() -> None:
    """GQA with head_dim 128 runs FP8 on every GPU the classifier names (Ampere through FlashInfer)."""
    for name, labels in KNOWN_PRODUCTS.items():
        facts = gpu_facts([labels])
        assert facts.generation is not GpuGeneration.UNKNOWN, name
        assert choose_backend(facts.generation, facts.compute_capability, False, 128).backend, name


# ------------------------------------------------------------------------------------ against vLLM's classes

CAPABILITIES = sorted({c for caps in GENERATION_CAPABILITIES.values() for c in caps} | {(7, 5), (9, 0), (12, 1)})


@pytest.fixture(scope="module")
def vllm_backends() -> dict[str, Any]:
    """vLLM's backend class for each row of the table, where it imports without CUDA (FlashInfer's need flashinfer)."""
    registry = pytest.importorskip("vllm.v1.attention.backends.registry", reason="vLLM is not installed")
    classes: dict[str, Any] = {}
    for name in BACKENDS:
        module, _, attribute = registry.AttentionBackendEnum[name].get_path().rpartition(".")
        try:
            classes[name] = getattr(importlib.import_module(module), attribute)
        except (ImportError, AssertionError, RuntimeError):
            continue
    return classes


def test_every_planned_backend_is_a_vllm_backend(vllm_backends: dict[str, Any]) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert set(BACKENDS) <= {member.name for member in AttentionBackendEnum}
    # The CPU build imports these four; the test must check something.
    assert {"FLASH_ATTN", "TRITON_ATTN", "FLASHMLA", "TRITON_MLA"} <= set(vllm_backends)


def test_the_table_claims_no_more_than_vllm_supports(vllm_backends: dict[str, Any]) -> None:
    from vllm.platforms.interface import DeviceCapability

    for name, cls in vllm_backends.items():
        backend = BACKENDS[name]
        assert cls.get_name() == name
        assert "fp8" in cls.supported_kv_cache_dtypes, name
        for major, minor in CAPABILITIES:
            if backend.runs_fp8_on((major, minor)):
                assert cls.supports_compute_capability(DeviceCapability(major, minor)), (name, major, minor)
        if not backend.mla:
            for head_size in range(8, 257, 8):
                if backend.supports_head_size(head_size):
                    assert cls.supports_head_size(head_size), (name, head_size)


def test_flashmla_capabilities_are_exactly_vllms(vllm_backends: dict[str, Any]) -> None:
    from vllm.platforms.interface import DeviceCapability

    flashmla = vllm_backends["FLASHMLA"]
    for capability in CAPABILITIES:
        assert BACKENDS["FLASHMLA"].runs_fp8_on(capability) == flashmla.supports_compute_capability(
            DeviceCapability(*capability)
        ), capability


# ------------------------------------------------------------------------------------------------ mixed pools


def test_a_mixed_hopper_blackwell_pool_gets_no_backend_only_one_kind_runs() -> None:
    """FLASH_ATTN's FP8 KV cache is Hopper-only: planned for 2x H200 + 1x B200, pods landing on the B200 would not
    start. The backend must run on every GPU the pods may land on, else the plan is BF16."""
    facts = gpu_facts([KNOWN_PRODUCTS["H200"], KNOWN_PRODUCTS["H200"], KNOWN_PRODUCTS["B200"]])
    assert facts.pool_capabilities == ["9.0", "10.0"]
    choice = choose_backend(facts.generation, facts.compute_capability, False, 128, facts.pool_capabilities)
    assert choice.backend is None
    assert "compute capability 9.0 and 10.0 in the same pool" in choice.reason
    assert "FLASH_ATTN: its FP8 KV cache needs FlashAttention 3" in choice.reason


def test_a_pool_of_one_kind_plans_as_before() -> None:
    facts = gpu_facts([KNOWN_PRODUCTS["H200"], KNOWN_PRODUCTS["H100"]])
    assert facts.pool_capabilities == ["9.0"]
    assert choose_backend(facts.generation, facts.compute_capability, False, 128, facts.pool_capabilities).backend
