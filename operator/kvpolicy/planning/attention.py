"""Which vLLM attention backends can serve an FP8 KV cache on which GPU: the table the planner picks from.

A backend named with `--attention-backend` that the GPU cannot run makes vLLM refuse to start, and the canary
crash-loops until the progress deadline. So the planner only names a backend whose FP8 KV path exists on every compute
capability the target's GPUs may have, for the model's head size.

Source: vLLM 0.32.0, `vllm/v1/attention/backends/` (the CUDA backends' Python ships in every wheel, also in the CPU
build installed here); each row names the code it follows, and tests/api/test_attention.py checks the rows against the
backend classes that import without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpolicy.api.v1alpha1 import GpuGeneration

Capability = tuple[int, int]


@dataclass(frozen=True)
class Backend:
    """An attention backend and where it can serve an FP8 KV cache."""

    name: str  # the --attention-backend value
    mla: bool
    min_capability: Capability
    max_capability: Capability = (99, 99)
    majors: frozenset[int] | None = None  # only these major versions, when set
    head_sizes: frozenset[int] | None = None  # only these head sizes, when set
    max_head_size: int | None = None
    min_head_size: int = 1
    head_size_multiple: int = 1
    reason: str = ""  # why the FP8 path is limited so; quoted when it rules the backend out
    source: str = ""  # where vLLM says so

    def runs_fp8_on(self, capability: Capability) -> bool:
        in_range = self.min_capability <= capability <= self.max_capability
        return in_range and (self.majors is None or capability[0] in self.majors)

    def supports_head_size(self, head_size: int) -> bool:
        if self.mla:
            return True  # MLA backends take the latent size the model fixes (576 for DeepSeek)
        if self.head_sizes is not None:
            return head_size in self.head_sizes
        fits_max = self.max_head_size is None or head_size <= self.max_head_size
        return fits_max and head_size >= self.min_head_size and head_size % self.head_size_multiple == 0


BACKENDS = {
    backend.name: backend
    for backend in (
        Backend(
            "FLASH_ATTN",
            mla=False,
            min_capability=(9, 0),
            majors=frozenset({9}),
            max_head_size=256,
            head_size_multiple=8,
            reason="its FP8 KV cache needs FlashAttention 3, which runs on compute capability 9.x only",
            source="flash_attn.py supports_head_size; fa_utils.py flash_attn_supports_kv_cache_dtype (FA3 on SM90)",
        ),
        Backend(
            "FLASHINFER",
            mla=False,
            min_capability=(8, 0),
            max_capability=(12, 1),
            head_sizes=frozenset({64, 128, 256, 512}),
            reason="it runs on compute capability 8.0 to 12.1 with head sizes 64, 128, 256 and 512",
            source="flashinfer.py supports_compute_capability, get_supported_head_sizes",
        ),
        Backend(
            "TRITON_ATTN",
            mla=False,
            min_capability=(8, 9),
            min_head_size=32,
            reason="its FP8 KV cache needs native FP8 (compute capability 8.9 and above)",
            source="triton_attn.py TritonAttentionImpl.__init__ (FP8 needs SM89+), supports_head_size",
        ),
        Backend(
            "FLASHMLA",
            mla=True,
            min_capability=(9, 0),
            majors=frozenset({9, 10}),
            reason="FlashMLA runs on compute capability 9.x and 10.x only",
            source="mla/flashmla.py supports_compute_capability",
        ),
        Backend(
            "FLASHINFER_MLA",
            mla=True,
            min_capability=(10, 0),
            majors=frozenset({10}),
            reason="it runs on compute capability 10.x only",
            source="mla/flashinfer_mla.py supports_compute_capability",
        ),
        Backend(
            "TRITON_MLA",
            mla=True,
            min_capability=(8, 9),
            reason="its FP8 KV cache needs native FP8 (compute capability 8.9 and above)",
            source="mla/triton_mla.py TritonMLAImpl.__init__ (FP8 needs SM89+)",
        ),
    )
}

# The `kvkernels.probe --backend` that measures each planned backend's own FP8 attention (kernels/README.md). A backend
# missing here is not probed: the probe's `triton` backend is kvkernels' kernel, which no vLLM backend serves with.
PROBE_BACKENDS: dict[str, str] = {"FLASH_ATTN": "vllm-fa3"}

# The backends whose FP8 attention promotes partial sums (two-level accumulation): vLLM's FA3 since
# vllm-project/flash-attention#104, in vLLM through vllm#27889. No other vLLM backend has the fix.
TWO_LEVEL_BACKENDS = frozenset({"FLASH_ATTN"})

# The backends each generation is planned with, first choice first. Hopper and Ada truncate FP8 accumulation: there
# the backend is the one the patched image carries two-level accumulation for (FA3 on Hopper, vllm#27889).
PREFERENCES: dict[tuple[GpuGeneration, bool], tuple[str, ...]] = {
    (GpuGeneration.HOPPER, False): ("FLASH_ATTN",),
    (GpuGeneration.HOPPER, True): ("FLASHMLA",),
    (GpuGeneration.ADA, False): ("TRITON_ATTN",),
    (GpuGeneration.ADA, True): ("TRITON_MLA",),
    (GpuGeneration.AMPERE, False): ("FLASHINFER",),
    (GpuGeneration.AMPERE, True): ("TRITON_MLA",),
    (GpuGeneration.BLACKWELL, False): ("FLASHINFER", "TRITON_ATTN"),
    (GpuGeneration.BLACKWELL, True): ("FLASHINFER_MLA", "FLASHMLA", "TRITON_MLA"),
}

# When the labels give a generation but no compute capability (a family or product label only), the backend must run
# on every capability of that generation.
GENERATION_CAPABILITIES: dict[GpuGeneration, tuple[Capability, ...]] = {
    GpuGeneration.HOPPER: ((9, 0),),
    GpuGeneration.ADA: ((8, 9),),
    GpuGeneration.AMPERE: ((8, 0), (8, 6), (8, 7)),
    GpuGeneration.BLACKWELL: ((10, 0), (10, 3), (11, 0), (12, 0), (12, 1)),
}


def parse_capability(text: str) -> Capability:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


@dataclass(frozen=True)
class Choice:
    """The backend chosen, or None with the reason none fits."""

    backend: str | None
    reason: str
    avoided: tuple[str, ...] = ()  # preferred backends passed over as known-bad combinations, with why


# Why a backend must not be picked on a compute capability although it runs there (a known-bad combination of the
# vLLM version table), or None.
Avoid = Callable[[str, Capability], str | None]


def _avoid_none(name: str, capability: Capability) -> str | None:
    return None


def pool(generation: GpuGeneration, capability: str | None, also_on: Sequence[str]) -> tuple[list[Capability], str]:
    """Every compute capability the pods may land on (the GPU's own, or all of its generation's when unknown, then
    `also_on`), and how to say where that is."""
    own = (parse_capability(capability),) if capability else GENERATION_CAPABILITIES.get(generation, ())
    others = sorted({parse_capability(text) for text in also_on} - set(own))
    where = f"compute capability {capability}" if capability else f"{generation.value} GPUs"
    if others:
        where += " and " + ", ".join("{}.{}".format(*other) for other in others) + " in the same pool"
    return [*own, *others], where


def choose_backend(
    generation: GpuGeneration,
    capability: str | None,
    mla: bool,
    head_size: int,
    also_on: Sequence[str] = (),
    avoid: Avoid = _avoid_none,
) -> Choice:
    """The first preferred backend of the generation that runs an FP8 KV cache for this head size on the GPU and on
    every other compute capability the pods may land on (`also_on`: a pool that mixes GPUs), and that `avoid` does
    not rule out on any of them (the planner passes the version table's known-bad combinations)."""
    capabilities, where = pool(generation, capability, also_on)
    preferred = PREFERENCES.get((generation, mla), ())
    refusals = []
    avoided: list[str] = []
    for name in preferred:
        backend = BACKENDS[name]
        if not all(backend.runs_fp8_on(c) for c in capabilities):
            refusals.append(f"{name}: {backend.reason}")
        elif not backend.supports_head_size(head_size):
            refusals.append(f"{name}: {backend.reason}, not head_dim {head_size}")
        elif bad := next((why for c in capabilities if (why := avoid(name, c)) is not None), None):
            refusals.append(f"{name}: {bad}")
            avoided.append(f"{name} passed over: {bad}")
        else:
            return Choice(name, f"{name} runs an FP8 KV cache on {where}", tuple(avoided))
    kind = "MLA" if mla else f"head_dim {head_size}"
    return Choice(
        None, f"no vLLM attention backend serves an FP8 KV cache for {kind} on {where} ({'; '.join(refusals)})"
    )


def _capabilities(backend: Backend) -> str:
    if backend.majors is not None:
        return " and ".join(f"{major}.x" for major in sorted(backend.majors))
    if backend.max_capability == (99, 99):
        return "{}.{} and above".format(*backend.min_capability)
    return "{}.{} to {}.{}".format(*backend.min_capability, *backend.max_capability)


def _head_sizes(backend: Backend) -> str:
    if backend.mla:
        return "(MLA)"
    if backend.head_sizes is not None:
        return ", ".join(str(size) for size in sorted(backend.head_sizes))
    parts = [f"multiple of {backend.head_size_multiple}"] if backend.head_size_multiple > 1 else []
    parts += [f">= {backend.min_head_size}"] if backend.min_head_size > 1 else []
    parts += [f"<= {backend.max_head_size}"] if backend.max_head_size is not None else []
    return ", ".join(parts)


def table_markdown() -> str:
    """The backend table as Markdown (the README embeds it; a test keeps it in step)."""
    planned: dict[str, list[str]] = {}
    for (generation, _mla), names in PREFERENCES.items():
        for name in names:
            planned.setdefault(name, []).append(generation.value)
    rows = [
        "| backend | MLA | FP8 KV cache on compute capability | head sizes | tried on (first choice first) "
        "| vLLM 0.32.0 source (`vllm/v1/attention/backends/`) |",
        "|---|---|---|---|---|---|",
    ]
    for backend in BACKENDS.values():
        rows.append(
            f"| `{backend.name}` | {'yes' if backend.mla else 'no'} | {_capabilities(backend)} | "
            f"{_head_sizes(backend)} | {', '.join(planned.get(backend.name, []))} | {backend.source} |"
        )
    return "\n".join(rows)
