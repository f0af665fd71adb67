"""A simulated vLLM server: the `vllm serve` flags it mirrors, plus the hardware and image it pretends to run on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpolicy_dev.numerics import Accumulation
from kvpolicy_dev.sim.hardware import Gpu
from kvpolicy_dev.sim.models import DEFAULT_PROFILE, ModelProfile

__all__ = ["FP8_KV_DTYPES", "KV_CACHE_DTYPES", "KV_HEADS", "SKIP_SLIDING_WINDOW", "Gpu", "SimConfig"]

FP8_KV_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16")
SKIP_SLIDING_WINDOW = "sliding_window"
# Grouped-query attention caches K and V for this many heads per layer (Llama-3.1-8B's count, assumed for all).
KV_HEADS = 8


@dataclass(frozen=True)
class SimConfig:
    served_model_name: str = "meta-llama/Llama-3.1-8B-Instruct"
    kv_cache_dtype: str = "auto"
    # `--kv-cache-dtype-skip-layers`: "sliding_window" and/or layer indices kept in BF16.
    skip_layers: tuple[str, ...] = ()
    attention_backend: str | None = None
    max_model_len: int = 131072
    gpu: Gpu = Gpu.H100
    two_level_fix: bool = False
    fast_head_dim_256: bool = False
    # Relative attention error that FP8 KV scales of 1.0 on a model with outlier channels add at every length (the
    # vLLM FP8 KV blog's Kimi-K2.5 on FlashMLA: "consistently negative" across length buckets, modest in aggregate),
    # on top of the accumulation's. 0.30 costs about 2% of needles at every length (see sim.accuracy).
    kv_scale_error: float = 0.0
    head_dim: int = 128
    num_layers: int = 32
    sliding_window_layers: int = 0
    sliding_window_tokens: int = 4096
    # The catalogue entry whose published latency fits apply (and whether attention is MLA); the shape fields above
    # are what the server simulates.
    profile: ModelProfile = DEFAULT_PROFILE
    time_scale: float = 1.0
    latency_multiplier: float = 1.0
    seed: int = 0
    # `--tokenizer`: a Hugging Face model directory (or tokenizer.json) whose tokenizer the server uses instead of the
    # built-in word tokenizer (kvpolicy_dev.sim.tokenizer).
    tokenizer: Path | None = None
    # Whether the served model has a chat template (`--no-chat-template`: a base model's server, whose /tokenize and
    # /v1/chat/completions refuse messages as vLLM 0.32 does).
    chat_template: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0 <= self.sliding_window_layers < self.num_layers:
            raise ValueError(
                f"sliding_window_layers must be between 0 and num_layers - 1 ({self.num_layers - 1}), "
                f"got {self.sliding_window_layers}"
            )
        for name in ("head_dim", "num_layers", "sliding_window_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.kv_scale_error < 1:
            raise ValueError(f"kv_scale_error must be in [0, 1), got {self.kv_scale_error}")
        if self.time_scale < 0 or self.latency_multiplier <= 0:
            raise ValueError("time_scale must be >= 0 and latency_multiplier > 0")
        for entry in self.skip_layers:
            if entry != SKIP_SLIDING_WINDOW and not (entry.isdigit() and int(entry) < self.num_layers):
                raise ValueError(
                    f"--kv-cache-dtype-skip-layers takes {SKIP_SLIDING_WINDOW!r} or layer indices below "
                    f"{self.num_layers}, got {entry!r}"
                )

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype in FP8_KV_DTYPES

    @property
    def layer_kv_elements(self) -> int:
        """Cached elements per token in one layer: K and V of every KV head, or one MLA latent."""
        return self.head_dim if self.profile.mla else 2 * KV_HEADS * self.head_dim

    def is_sliding_window(self, layer: int) -> bool:
        """Sliding-window layers are spread evenly: the full-attention layers are evenly spaced, the last included."""
        global_layers = self.num_layers - self.sliding_window_layers
        return all(round((g + 1) * self.num_layers / global_layers) - 1 != layer for g in range(global_layers))

    def layer_is_fp8(self, layer: int) -> bool:
        skipped = str(layer) in self.skip_layers or (
            SKIP_SLIDING_WINDOW in self.skip_layers and self.is_sliding_window(layer)
        )
        return self.fp8 and not skipped

    def layer_accumulation(self, layer: int) -> Accumulation:
        """How this layer's attention accumulates P·V on this GPU with this image."""
        if not self.layer_is_fp8(layer):
            return Accumulation.BF16
        major, _ = self.gpu.compute_capability
        if major == 9:
            return Accumulation.FP8_TWO_LEVEL if self.two_level_fix else Accumulation.FP8_SINGLE_LEVEL
        # Blackwell accumulates FP8 MMAs without truncation; Ampere and Ada kernels dequantise the FP8 cache to BF16
        # before the MMA, so neither truncates the way Hopper's fed-back FP8 accumulator does.
        return Accumulation.FP8_BLACKWELL

    def layer_context(self, layer: int, prompt_tokens: int) -> int:
        """Keys a layer attends to for the last prompt token."""
        if self.is_sliding_window(layer):
            return min(prompt_tokens, self.sliding_window_tokens)
        return prompt_tokens
