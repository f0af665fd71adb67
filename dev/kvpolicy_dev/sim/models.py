"""The simulator's model catalogue: the published models' shapes and latency fits, looked up by model name.

A `vllm serve` command line names the model but not its architecture, so `kvpolicy sim` picks a profile from the
model name (the positional MODEL first, then `--served-model-name`; a case-insensitive regular-expression search):

| profile | matches | head_dim | layers | sliding window | published fits (vLLM blog 2026-04-22) |
|---|---|---|---|---|---|
| llama-3.1-8b | llama-3.1-8b | 128 | 32 | - | the GPU tables of kvpolicy_dev.sim.latency are its fits |
| gpt-oss-20b | gpt-oss-20b | 64 | 24 | 12 layers x 128 | ITL on H100 (BF16, FP8, FP8 skipping SW layers) and B200 |
| gemma-e2b | gemma-<version>-e2b | 256 | 30 | 24 layers x 512 | ITL and FP8 TTFT quadratic coefficient on H100 |
| qwen3-8b | qwen3-8b | 128 | 36 | - | none: the width model |
| deepseek-v2-lite | deepseek-v2-lite | 576 (MLA latent) | 27 | - | none: the width model |

An unknown name gets `DEFAULT_PROFILE` (Llama-3.1-8B-like). Explicit `--head-dim`, `--num-layers` and
`--sliding-window-*` flags override the profile's shape field by field; the profile's published fits still apply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpolicy_dev.sim.hardware import Gpu


@dataclass(frozen=True)
class PublishedItl:
    """A published concurrency-1 decode fit on one GPU: ITL slopes in ms per context token.

    `fp8_slope_ms` has every layer in FP8 (`--kv-cache-dtype fp8` alone); `break_even_tokens` is against the
    sliding-window-skipping FP8 slope when one is published, else against `fp8_slope_ms`.
    """

    bf16_slope_ms: float
    fp8_slope_ms: float
    fp8_skip_sliding_window_slope_ms: float | None = None
    break_even_tokens: float | None = None


# eq=False: profiles are catalogue singletons, compared and hashed by identity (their fit tables are dicts).
@dataclass(frozen=True, eq=False)
class ModelProfile:
    """One model's shape and the published latency fits the simulator calibrates against."""

    name: str
    pattern: str | None  # regular expression searched in the model name, case-insensitive; None: never matched
    head_dim: int
    num_layers: int
    sliding_window_layers: int = 0
    sliding_window_tokens: int = 4096
    # Multi-head latent attention caches one head_dim-wide latent per layer and token (no separate K and V heads).
    mla: bool = False
    itl_fits: Mapping[Gpu, PublishedItl] = field(default_factory=dict)
    # TTFT quadratic coefficient (ms per token^2) with an FP8 cache and single-level accumulation.
    fp8_ttft_quad_ms: Mapping[Gpu, float] = field(default_factory=dict)

    def matches(self, model_name: str) -> bool:
        return self.pattern is not None and re.search(self.pattern, model_name, re.IGNORECASE) is not None


DEFAULT_PROFILE = ModelProfile(name="default (Llama-3.1-8B-like)", pattern=None, head_dim=128, num_layers=32)

CATALOGUE = (
    ModelProfile(name="llama-3.1-8b", pattern=r"llama-3\.1-8b(?!\d)", head_dim=128, num_layers=32),
    ModelProfile(
        name="gpt-oss-20b",
        pattern=r"gpt-oss-20b",
        head_dim=64,
        num_layers=24,
        sliding_window_layers=12,
        sliding_window_tokens=128,
        itl_fits={
            Gpu.H100: PublishedItl(8.94e-6, 7.14e-6, fp8_skip_sliding_window_slope_ms=6.34e-6, break_even_tokens=7659),
            Gpu.B200: PublishedItl(3.56e-6, 2.06e-6, break_even_tokens=13000),
        },
    ),
    ModelProfile(
        name="gemma-e2b",
        pattern=r"gemma-[0-9a-z.]+-e2b",
        head_dim=256,
        num_layers=30,
        sliding_window_layers=24,
        sliding_window_tokens=512,
        itl_fits={Gpu.H100: PublishedItl(5.30e-5, 3.60e-5)},
        fp8_ttft_quad_ms={Gpu.H100: 6.93e-7},
    ),
    ModelProfile(name="qwen3-8b", pattern=r"qwen3-8b(?!\d)", head_dim=128, num_layers=36),
    ModelProfile(name="deepseek-v2-lite", pattern=r"deepseek-v2-lite", head_dim=576, num_layers=27, mla=True),
)


def find_profile(*model_names: str | None) -> ModelProfile | None:
    """The profile of the first name that a catalogue entry matches; None when no name does."""
    for model_name in model_names:
        if model_name:
            for profile in CATALOGUE:
                if profile.matches(model_name):
                    return profile
    return None
