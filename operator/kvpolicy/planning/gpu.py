"""GPU facts from NVIDIA GPU Feature Discovery node labels.

Decide on compute capability first, then `nvidia.com/gpu.family`, then `nvidia.com/gpu.product` (time-slicing
appends `-SHARED` to the product). When the target's nodes span generations, the most conservative one wins.
`PRODUCTS` is the one table of GPUs the classifier knows by name: `kvpolicy plan --gpu` takes its names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpolicy.api.v1alpha1 import GpuFacts, GpuGeneration
from kvpolicy.planning.attention import GENERATION_CAPABILITIES, parse_capability

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

# GFD's nvidia.com/gpu.family values (first one per generation is what GFD writes).
_FAMILIES = {
    "ampere": GpuGeneration.AMPERE,
    "ada-lovelace": GpuGeneration.ADA,
    "ada": GpuGeneration.ADA,
    "hopper": GpuGeneration.HOPPER,
    "blackwell": GpuGeneration.BLACKWELL,
}
_FAMILY_LABEL_VALUE = {generation: family for family, generation in reversed(_FAMILIES.items())}


def _from_compute_capability(major: int, minor: int) -> GpuGeneration:
    if major in (10, 11, 12):
        return GpuGeneration.BLACKWELL
    if major == 9:
        return GpuGeneration.HOPPER
    if major == 8:
        return GpuGeneration.ADA if minor == 9 else GpuGeneration.AMPERE
    return GpuGeneration.UNKNOWN


@dataclass(frozen=True)
class Product:
    """A GPU the classifier knows by name, with the labels GPU Feature Discovery puts on its nodes."""

    name: str  # what `kvpolicy plan --gpu` takes; also the words that identify it in a product label
    gfd_product: str  # nvidia.com/gpu.product as GFD writes it (the device name, spaces as dashes)
    compute_capability: tuple[int, int]

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(self.name.upper().split("-"))

    @property
    def generation(self) -> GpuGeneration:
        return _from_compute_capability(*self.compute_capability)

    @property
    def labels(self) -> dict[str, str]:
        major, minor = self.compute_capability
        return {
            PRODUCT_LABEL: self.gfd_product,
            FAMILY_LABEL: _FAMILY_LABEL_VALUE[self.generation],
            CC_MAJOR_LABEL: str(major),
            CC_MINOR_LABEL: str(minor),
        }


# Compute capabilities from NVIDIA's CUDA GPU list (developer.nvidia.com/cuda-gpus). A product label matches a row
# when the row's words appear in it in order, whole: A10 does not match A100, L4 does not match L40S.
PRODUCTS = (
    Product("H100", "NVIDIA-H100-80GB-HBM3", (9, 0)),
    Product("H200", "NVIDIA-H200", (9, 0)),
    Product("H800", "NVIDIA-H800", (9, 0)),
    Product("H20", "NVIDIA-H20", (9, 0)),
    Product("GH200", "NVIDIA-GH200-480GB", (9, 0)),
    Product("B100", "NVIDIA-B100", (10, 0)),
    Product("B200", "NVIDIA-B200", (10, 0)),
    Product("GB200", "NVIDIA-GB200", (10, 0)),
    Product("B300", "NVIDIA-B300-SXM6-AC", (10, 3)),
    Product("GB300", "NVIDIA-GB300", (10, 3)),
    Product("RTX-PRO-6000", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", (12, 0)),
    Product("RTX-5090", "NVIDIA-GeForce-RTX-5090", (12, 0)),
    Product("L40S", "NVIDIA-L40S", (8, 9)),
    Product("L40", "NVIDIA-L40", (8, 9)),
    Product("L4", "NVIDIA-L4", (8, 9)),
    Product("RTX-6000-ADA", "NVIDIA-RTX-6000-Ada-Generation", (8, 9)),
    Product("RTX-4090", "NVIDIA-GeForce-RTX-4090", (8, 9)),
    Product("A100", "NVIDIA-A100-SXM4-80GB", (8, 0)),
    Product("A800", "NVIDIA-A800-SXM4-80GB", (8, 0)),
    Product("A30", "NVIDIA-A30", (8, 0)),
    Product("A10", "NVIDIA-A10", (8, 6)),
    Product("A10G", "NVIDIA-A10G", (8, 6)),
    Product("A40", "NVIDIA-A40", (8, 6)),
    Product("RTX-A6000", "NVIDIA-RTX-A6000", (8, 6)),
    Product("RTX-3090", "NVIDIA-GeForce-RTX-3090", (8, 6)),
)
PRODUCTS_BY_NAME = {product.name: product for product in PRODUCTS}
# Other products whose label names their architecture ("NVIDIA-RTX-PRO-4500-Blackwell"): generation only.
_ARCHITECTURE_WORDS = {"BLACKWELL": GpuGeneration.BLACKWELL, "HOPPER": GpuGeneration.HOPPER, "ADA": GpuGeneration.ADA}
# Labels of one node of each named product (tests and `kvpolicy plan --gpu NAME`).
KNOWN_PRODUCTS: dict[str, dict[str, str]] = {product.name: product.labels for product in PRODUCTS}

_WORD_SEPARATORS = re.compile(r"[-_\s]+")


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


def _words(product_label: str) -> tuple[str, ...]:
    return tuple(word for word in _WORD_SEPARATORS.split(product_label.upper().removesuffix(SHARED_SUFFIX)) if word)


def find_product(product_label: str) -> Product | None:
    """The named product a GFD product string (or a short name, any case) is, if any."""
    words = _words(product_label)
    for product in PRODUCTS:
        size = len(product.words)
        if any(words[start : start + size] == product.words for start in range(len(words) - size + 1)):
            return product
    return None


def product_labels(name: str) -> dict[str, str] | None:
    """A node's labels for the GPU `name` (a short name such as H100 or RTX 4090, or a GFD product string); None if
    the classifier does not know it."""
    product = find_product(name)
    if product is None:
        return None
    if _words(name.upper().removeprefix("NVIDIA-")) == product.words:
        return product.labels
    # A whole product string ("NVIDIA-H100-NVL"): keep it as the node's product label.
    return {**product.labels, PRODUCT_LABEL: name}


def classify_node(labels: Mapping[str, str]) -> tuple[GpuGeneration, str, str | None]:
    """(generation, which label decided, compute capability "M.m" if known) for one node."""
    major, minor = _parse_int(labels.get(CC_MAJOR_LABEL)), _parse_int(labels.get(CC_MINOR_LABEL))
    if major is not None:
        capability = f"{major}.{minor or 0}"
        return _from_compute_capability(major, minor or 0), "ComputeCapability", capability
    family = _FAMILIES.get(labels.get(FAMILY_LABEL, "").lower())
    if family is not None:
        return family, "Family", None
    label = product_name(labels) or ""
    product = find_product(label)
    if product is not None:
        return product.generation, "Product", "{}.{}".format(*product.compute_capability)
    for word in _words(label):
        if word in _ARCHITECTURE_WORDS:
            return _ARCHITECTURE_WORDS[word], "Product", None
    return GpuGeneration.UNKNOWN, "None", None


def pool_capabilities(classified: Sequence[tuple[GpuGeneration, str, str | None]]) -> list[str]:
    """Every compute capability among classified nodes; a node known only by its generation could be any of that
    generation's."""
    found: set[str] = set()
    for generation, _source, capability in classified:
        if capability is not None:
            found.add(capability)
        else:
            found.update("{}.{}".format(*known) for known in GENERATION_CAPABILITIES.get(generation, ()))
    return sorted(found, key=parse_capability)


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
        pool_capabilities=pool_capabilities([c for c, _ in classified]),
        product=product,
        nodes=len(nodes),
        mixed=mixed,
        source=source,
        message=message,
    )


def describe(facts: GpuFacts) -> str:
    """One line naming the GPUs facts describe: "NVIDIA-H200 (Hopper, compute capability 9.0)"."""
    details = [facts.generation.value]
    if facts.compute_capability:
        details.append(f"compute capability {facts.compute_capability}")
    if facts.mixed:
        details.append("mixed generations")
    return f"{facts.product or 'unnamed GPU'} ({', '.join(details)})"


def planning_change(planned: GpuFacts, observed: GpuFacts) -> str | None:
    """What changed between the GPU facts a plan was made for and those observed now, when it could change the plan;
    None otherwise.

    Only known facts change a plan: nodes that lose their labels (GPU Feature Discovery restarting) or leave the pool
    say nothing about the GPUs, so a rollout keeps its plan and its gates keep judging the pool as it is. A plan made
    on an unknown GPU is made again as soon as the labels name one. The product alone does not count (an H200 joining
    H100s plans the same), the compute capability does where both are known (Blackwell 10.0 and 12.0 differ)."""
    if observed.generation == GpuGeneration.UNKNOWN:
        return None
    capabilities = (planned.compute_capability, observed.compute_capability)
    pools = (planned.pool_capabilities, observed.pool_capabilities)
    same = (
        planned.generation == observed.generation
        and planned.mixed == observed.mixed
        and (None in capabilities or capabilities[0] == capabilities[1])
        and ([] in pools or pools[0] == pools[1])
    )
    return None if same else f"{describe(planned)} -> {describe(observed)}"


def _expression_holds(value: str | None, operator: str, values: Sequence[str]) -> bool:
    """One NodeSelectorRequirement against a node's label value (None: the node lacks the label)."""
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and values:
        try:
            mine, bound = int(value), int(values[0])
        except ValueError:
            return False
        return mine > bound if operator == "Gt" else mine < bound
    return False


def required_affinity_admits(name: str, labels: Mapping[str, str], affinity: Mapping[str, Any] | None) -> bool:
    """Whether the scheduler may place a pod with this affinity on the node: requiredDuringScheduling node affinity
    (terms ORed, each term's expressions ANDed, matchFields on metadata.name). No such affinity admits every node."""
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = (required or {}).get("nodeSelectorTerms") or []
    if not terms:
        return True

    def term_holds(term: Mapping[str, Any]) -> bool:
        expressions = [(labels.get(e.get("key", "")), e) for e in term.get("matchExpressions") or []]
        fields = [(name if e.get("key") == "metadata.name" else None, e) for e in term.get("matchFields") or []]
        checks = [*expressions, *fields]
        return bool(checks) and all(
            _expression_holds(value, str(e.get("operator")), [str(v) for v in e.get("values") or []])
            for value, e in checks
        )

    return any(term_holds(term) for term in terms)
