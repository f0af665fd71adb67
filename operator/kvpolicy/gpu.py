"""GPU facts from NVIDIA GPU Feature Discovery node labels.

Decide on compute capability first, then `nvidia.com/gpu.family`, then `nvidia.com/gpu.product` (time-slicing
appends `-SHARED` to the product). When the target's nodes span generations, the most conservative one wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpolicy.api.v1alpha1 import GpuFacts, GpuGeneration

PRODUCT_LABEL = "nvidia.com/gpu.product"
FAMILY_LABEL = "nvidia.com/gpu.family"
CC_MAJOR_LABEL = "nvidia.com/gpu.compute.major"
CC_MINOR_LABEL = "nvidia.com/gpu.compute.minor"
PRESENT_LABEL = "nvidia.com/gpu.present"
SHARED_SUFFIX = "-SHARED"

# Most conservative last: a mixed pool is planned for the worst of its generations.
CONSERVATIVE_ORDER = (
    GpuGeneration.BLACKWELL,
    GpuGeneration.HOPPER,
    GpuGeneration.ADA,
    GpuGeneration.AMPERE,
    GpuGeneration.UNKNOWN,
)

_FAMILIES = {
    "hopper": GpuGeneration.HOPPER,
    "blackwell": GpuGeneration.BLACKWELL,
    "ampere": GpuGeneration.AMPERE,
    "ada-lovelace": GpuGeneration.ADA,
    "ada": GpuGeneration.ADA,
}

# Product substrings, checked in order (GH200 before H200, GB200 before B200 does not matter: same generation).
_PRODUCTS = (
    ("GH200", GpuGeneration.HOPPER),
    ("H100", GpuGeneration.HOPPER),
    ("H200", GpuGeneration.HOPPER),
    ("H800", GpuGeneration.HOPPER),
    ("H20", GpuGeneration.HOPPER),
    ("B200", GpuGeneration.BLACKWELL),
    ("B300", GpuGeneration.BLACKWELL),
    ("B100", GpuGeneration.BLACKWELL),
    ("BLACKWELL", GpuGeneration.BLACKWELL),
    ("A100", GpuGeneration.AMPERE),
    ("A800", GpuGeneration.AMPERE),
    ("A30", GpuGeneration.AMPERE),
    ("A10", GpuGeneration.AMPERE),
    ("A40", GpuGeneration.AMPERE),
    ("L40", GpuGeneration.ADA),
    ("L4", GpuGeneration.ADA),
)

# Labels a GPU Feature Discovery install would put on nodes of each product, for `kvpolicy plan --gpu`.
KNOWN_PRODUCTS: dict[str, dict[str, str]] = {
    "H100": {PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3", FAMILY_LABEL: "hopper", CC_MAJOR_LABEL: "9", CC_MINOR_LABEL: "0"},
    "H200": {PRODUCT_LABEL: "NVIDIA-H200", FAMILY_LABEL: "hopper", CC_MAJOR_LABEL: "9", CC_MINOR_LABEL: "0"},
    "B200": {PRODUCT_LABEL: "NVIDIA-B200", FAMILY_LABEL: "blackwell", CC_MAJOR_LABEL: "10", CC_MINOR_LABEL: "0"},
    "GB200": {PRODUCT_LABEL: "NVIDIA-GB200", FAMILY_LABEL: "blackwell", CC_MAJOR_LABEL: "10", CC_MINOR_LABEL: "0"},
    "A100": {
        PRODUCT_LABEL: "NVIDIA-A100-SXM4-80GB",
        FAMILY_LABEL: "ampere",
        CC_MAJOR_LABEL: "8",
        CC_MINOR_LABEL: "0",
    },
    "L40S": {PRODUCT_LABEL: "NVIDIA-L40S", FAMILY_LABEL: "ada-lovelace", CC_MAJOR_LABEL: "8", CC_MINOR_LABEL: "9"},
}


def _from_compute_capability(major: int, minor: int) -> GpuGeneration:
    if major in (10, 11, 12):
        return GpuGeneration.BLACKWELL
    if major == 9:
        return GpuGeneration.HOPPER
    if major == 8:
        return GpuGeneration.ADA if minor == 9 else GpuGeneration.AMPERE
    return GpuGeneration.UNKNOWN


def _parse_int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def product_name(labels: Mapping[str, str]) -> str | None:
    product = labels.get(PRODUCT_LABEL)
    if not product:
        return None
    return product.removesuffix(SHARED_SUFFIX)


def classify_node(labels: Mapping[str, str]) -> tuple[GpuGeneration, str, str | None]:
    """(generation, which label decided, compute capability "M.m" if labelled) for one node."""
    major, minor = _parse_int(labels.get(CC_MAJOR_LABEL)), _parse_int(labels.get(CC_MINOR_LABEL))
    if major is not None:
        capability = f"{major}.{minor or 0}"
        return _from_compute_capability(major, minor or 0), "ComputeCapability", capability
    family = _FAMILIES.get(labels.get(FAMILY_LABEL, "").lower())
    if family is not None:
        return family, "Family", None
    product = (product_name(labels) or "").upper()
    for needle, generation in _PRODUCTS:
        if needle in product:
            return generation, "Product", None
    return GpuGeneration.UNKNOWN, "None", None


def gpu_facts(nodes: Sequence[Mapping[str, str]]) -> GpuFacts:
    """Facts for the pool a policy targets: the most conservative generation among its nodes wins."""
    if not nodes:
        return GpuFacts(
            generation=GpuGeneration.UNKNOWN,
            nodes=0,
            source="None",
            message="no GPU nodes match the target's node selector",
        )
    classified = [(classify_node(labels), labels) for labels in nodes]
    worst = max(classified, key=lambda item: CONSERVATIVE_ORDER.index(item[0][0]))
    (generation, source, capability), labels = worst
    generations = sorted({c[0][0] for c in classified}, key=CONSERVATIVE_ORDER.index)
    mixed = len(generations) > 1
    product = product_name(labels)
    described = product or (f"compute capability {capability}" if capability else "unlabelled GPU")
    if mixed:
        message = (
            f"nodes span {', '.join(g.value for g in generations)}; planning for the most conservative, "
            f"{generation.value} ({described})"
        )
    elif generation == GpuGeneration.UNKNOWN:
        message = f"{len(nodes)} node(s) without recognisable GPU labels ({described})"
    else:
        message = f"{len(nodes)} {generation.value} node(s) ({described}), decided by {source}"
    return GpuFacts(
        generation=generation,
        compute_capability=capability,
        product=product,
        nodes=len(nodes),
        mixed=mixed,
        source=source,
        message=message,
    )
