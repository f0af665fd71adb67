"""GPU facts from GPU Feature Discovery labels: a row per label variant."""

from __future__ import annotations

import pytest
from kvpolicy.api.v1alpha1 import GpuGeneration
from kvpolicy.planning.gpu import KNOWN_PRODUCTS, gpu_facts

H100 = KNOWN_PRODUCTS["H100"]
B200 = KNOWN_PRODUCTS["B200"]
A100 = KNOWN_PRODUCTS["A100"]
L40S = KNOWN_PRODUCTS["L40S"]

CASES = [
    # (labels, generation, deciding source, product)
    (H100, GpuGeneration.HOPPER, "ComputeCapability", "NVIDIA-H100-80GB-HBM3"),
    (KNOWN_PRODUCTS["H200"], GpuGeneration.HOPPER, "ComputeCapability", "NVIDIA-H200"),
    (B200, GpuGeneration.BLACKWELL, "ComputeCapability", "NVIDIA-B200"),
    (A100, GpuGeneration.AMPERE, "ComputeCapability", "NVIDIA-A100-SXM4-80GB"),
    (L40S, GpuGeneration.ADA, "ComputeCapability", "NVIDIA-L40S"),
    # RTX PRO 6000 Blackwell reports compute capability 12.0
    ({"nvidia.com/gpu.compute.major": "12", "nvidia.com/gpu.compute.minor": "0"}, GpuGeneration.BLACKWELL, None, None),
    # An old GFD labels Blackwell's family "undefined": the product decides.
    (
        {"nvidia.com/gpu.product": "NVIDIA-B200", "nvidia.com/gpu.family": "undefined"},
        GpuGeneration.BLACKWELL,
        "Product",
        "NVIDIA-B200",
    ),
    ({"nvidia.com/gpu.family": "hopper"}, GpuGeneration.HOPPER, "Family", None),
    # Time-slicing appends -SHARED to the product.
    (
        {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED"},
        GpuGeneration.HOPPER,
        "Product",
        "NVIDIA-H100-80GB-HBM3",
    ),
    ({"nvidia.com/gpu.product": "NVIDIA-GH200-480GB"}, GpuGeneration.HOPPER, "Product", "NVIDIA-GH200-480GB"),
    # Compute capability beats a contradicting product string.
    (
        {"nvidia.com/gpu.product": "NVIDIA-H100", "nvidia.com/gpu.compute.major": "10"},
        GpuGeneration.BLACKWELL,
        "ComputeCapability",
        "NVIDIA-H100",
    ),
    ({"nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.compute.major": "7"}, GpuGeneration.UNKNOWN, None, None),
    ({"nvidia.com/gpu.product": "Mystery-Accelerator"}, GpuGeneration.UNKNOWN, "None", "Mystery-Accelerator"),
    ({"kubernetes.io/hostname": "cpu-node"}, GpuGeneration.UNKNOWN, "None", None),
    ({"nvidia.com/gpu.compute.major": "nine"}, GpuGeneration.UNKNOWN, "None", None),
]


@pytest.mark.parametrize(("labels", "generation", "source", "product"), CASES)
def test_one_node(labels: dict[str, str], generation: GpuGeneration, source: str | None, product: str | None) -> None:
    facts = gpu_facts([labels])
    assert facts.generation == generation
    if source is not None:
        assert facts.source == source
    if product is not None:
        assert facts.product == product
    assert facts.nodes == 1 and not facts.mixed


def test_no_nodes_is_unknown_and_says_so() -> None:
    facts = gpu_facts([])
    assert facts.generation == GpuGeneration.UNKNOWN
    assert "no GPU nodes" in facts.message


@pytest.mark.parametrize(
    ("pool", "generation"),
    [
        ([B200, H100], GpuGeneration.HOPPER),
        ([H100, A100, B200], GpuGeneration.AMPERE),
        ([H100, L40S], GpuGeneration.ADA),
        ([B200, {"nvidia.com/gpu.product": "Mystery"}], GpuGeneration.UNKNOWN),
    ],
)
def test_mixed_pools_plan_for_the_most_conservative_and_say_so(
    pool: list[dict[str, str]], generation: GpuGeneration
) -> None:
    facts = gpu_facts(pool)
    assert facts.generation == generation
    assert facts.mixed and facts.nodes == len(pool)
    assert "most conservative" in facts.message and generation.value in facts.message


def test_same_generation_is_not_mixed() -> None:
    facts = gpu_facts([H100, KNOWN_PRODUCTS["H200"]])
    assert facts.generation == GpuGeneration.HOPPER and not facts.mixed


@pytest.mark.parametrize(
    ("product", "generation", "capability"),
    [
        # Whole words: A10 is not A100, L4 is not L40S, H20 is not H200.
        ("NVIDIA-A10", GpuGeneration.AMPERE, "8.6"),
        ("NVIDIA-A100-PCIE-40GB", GpuGeneration.AMPERE, "8.0"),
        ("NVIDIA-L4", GpuGeneration.ADA, "8.9"),
        ("NVIDIA-L40S-SHARED", GpuGeneration.ADA, "8.9"),
        ("NVIDIA-H20", GpuGeneration.HOPPER, "9.0"),
        ("NVIDIA-H800", GpuGeneration.HOPPER, "9.0"),
        ("NVIDIA-GeForce-RTX-4090", GpuGeneration.ADA, "8.9"),
        ("NVIDIA-RTX-6000-Ada-Generation", GpuGeneration.ADA, "8.9"),
        ("NVIDIA-RTX-A6000", GpuGeneration.AMPERE, "8.6"),
        ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", GpuGeneration.BLACKWELL, "12.0"),
        ("NVIDIA-B300-SXM6-AC", GpuGeneration.BLACKWELL, "10.3"),
        # An unnamed product that names its architecture: the generation, without a capability.
        ("NVIDIA-RTX-PRO-4500-Blackwell", GpuGeneration.BLACKWELL, None),
        ("NVIDIA-A1000", GpuGeneration.UNKNOWN, None),
    ],
)
def test_product_labels_give_generation_and_compute_capability(
    product: str, generation: GpuGeneration, capability: str | None
) -> None:
    facts = gpu_facts([{"nvidia.com/gpu.product": product}])
    assert (facts.generation, facts.compute_capability) == (generation, capability)
    assert facts.source == ("None" if generation is GpuGeneration.UNKNOWN else "Product")
