"""Latency model: the published concurrency-1 fits (vLLM blog, 2026-04-22; shared/reference/vllm-facts.md).

ITL(L) = slope·L + intercept and TTFT(L) = a·L² + b·L + c, in ms, for a Llama-3.1-8B-like reference model (32 layers,
head_dim 128, 8 KV heads). The width model scales the length terms by the KV width (cached elements per token) of a
configuration's full-attention layers; sliding-window layers attend to a bounded window and add nothing per context
token. A catalogued model with its own published fits (kvpolicy_dev.sim.models) gets factors on the width model that
reproduce them: on the GPU they were measured on, and carried to the others by the GPU tables below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvpolicy_dev.numerics import Accumulation
from kvpolicy_dev.sim.config import KV_HEADS, Gpu, SimConfig
from kvpolicy_dev.sim.models import ModelProfile

REFERENCE_KV_WIDTH = 32 * 2 * KV_HEADS * 128  # cached elements per token of the reference model


@dataclass(frozen=True)
class GpuLatency:
    itl_slope_ms: float  # BF16, ms per context token
    itl_intercept_ms: float
    fp8_slope_ratio: float
    fp8_intercept_delta_ms: float
    ttft_quad_ms: float  # BF16, ms per token^2
    ttft_linear_ms: float
    ttft_const_ms: float


# H100 and B200 ITL come from the blog's fits (B200's intercept gap from its ~4k break-even); H200, A100 and L40S scale
# H100's decode by HBM bandwidth (4.8, 2.0, 0.86 TB/s vs 3.35). Ampere and Ada dequantise FP8 before the MMA, so their
# FP8 gain is smaller (assumed 0.6). TTFT terms are estimates from dense BF16 throughput (A100 ~1/3, L40S ~0.37,
# B200 ~2.2x of H100).
GPU_LATENCY: dict[Gpu, GpuLatency] = {
    Gpu.H100: GpuLatency(4.37e-5, 6.44, 2.37 / 4.37, 0.14, 4.6e-7, 0.030, 15.0),
    Gpu.H200: GpuLatency(4.37e-5 * 3.35 / 4.8, 6.44 * 3.35 / 4.8, 2.37 / 4.37, 0.10, 4.6e-7, 0.030, 15.0),
    Gpu.B200: GpuLatency(1.80e-5, 2.70, 9.72 / 18.0, 4000 * (1.80e-5 - 9.72e-6), 2.1e-7, 0.014, 10.0),
    Gpu.A100: GpuLatency(4.37e-5 * 3.35 / 2.04, 6.44 * 3.35 / 2.04, 0.6, 0.30, 1.4e-6, 0.090, 25.0),
    Gpu.L40S: GpuLatency(4.37e-5 * 3.35 / 0.864, 6.44 * 3.35 / 0.864, 0.6, 0.50, 1.25e-6, 0.081, 25.0),
}
# gpt-oss-20b on H100: FP8 on its sliding-window layers too gives slope 7.14e-6 instead of 6.34e-6 with them skipped,
# with half its layers sliding-window: +12.6% per half. Models without a published pair use this one.
SLIDING_WINDOW_FP8_OVERHEAD = 2 * (7.14 / 6.34 - 1)
# FP8 attention prefill runs somewhat faster than BF16 on GPUs with FP8 MMAs (assumed; TTFT under load: 742.8 vs 763.6).
FP8_PREFILL_FACTOR = 0.9
# FA3 two-level accumulation at head_dim 256: TTFT quadratic coefficient 6.93e-7 -> 1.12e-6 (vLLM blog).
HEAD_DIM_256_TWO_LEVEL_PENALTY = 1.12e-6 / 6.93e-7
# Concurrency 8 on Llama-3.1-8B/H100 at ~20k context: median ITL 15.18 ms vs 7.3 ms alone -> +15.5% per extra request.
CONCURRENCY_SLOWDOWN = 0.155
TTFT_NOISE_SIGMA = 0.02
ITL_NOISE_SIGMA = 0.03


@dataclass(frozen=True)
class LatencyFit:
    itl_slope_ms: float
    itl_intercept_ms: float
    ttft_quad_ms: float
    ttft_linear_ms: float
    ttft_const_ms: float

    def itl_ms(self, context_tokens: float) -> float:
        return self.itl_slope_ms * context_tokens + self.itl_intercept_ms

    def ttft_ms(self, prompt_tokens: float) -> float:
        return self.ttft_quad_ms * prompt_tokens**2 + self.ttft_linear_ms * prompt_tokens + self.ttft_const_ms


@dataclass(frozen=True)
class ModelCalibration:
    """Factors on the width model (1.0: none) and the sliding-window FP8 overhead of one model."""

    itl_slope: float = 1.0
    fp8_slope_ratio: float = 1.0  # multiplies the GPU's FP8 slope ratio
    sliding_window_fp8_overhead: float = SLIDING_WINDOW_FP8_OVERHEAD
    fp8_intercept_delta: float = 1.0
    ttft_quad: float = 1.0


def _prefill_factor(gpu: Gpu) -> float:
    """FP8 attention prefill relative to BF16: faster only with FP8 tensor cores (compute capability 8.9 and up)."""
    return FP8_PREFILL_FACTOR if gpu.compute_capability >= (8, 9) else 1.0


def model_calibration(profile: ModelProfile, gpu: Gpu) -> ModelCalibration:
    """The factors that make the width model reproduce a profile's published fits (its catalogue shape).

    A fit counts on `gpu` where one was published for it, else the H100's carries over (an H200 decodes gpt-oss-20b
    as much faster than its H100 fit as Llama's H200 table is than Llama's H100 fit).
    """
    full_layers = profile.num_layers - profile.sliding_window_layers
    width = full_layers * (profile.head_dim if profile.mla else 2 * KV_HEADS * profile.head_dim) / REFERENCE_KV_WIDTH
    sliding_share = profile.sliding_window_layers / profile.num_layers
    calibration = ModelCalibration()
    itl_gpu = gpu if gpu in profile.itl_fits else Gpu.H100
    itl = profile.itl_fits.get(itl_gpu)
    if itl is not None:
        reference = GPU_LATENCY[itl_gpu]
        overhead = SLIDING_WINDOW_FP8_OVERHEAD
        if itl.fp8_skip_sliding_window_slope_ms is not None and sliding_share:
            skip_slope = break_even_slope = itl.fp8_skip_sliding_window_slope_ms
            overhead = (itl.fp8_slope_ms / skip_slope - 1) / sliding_share
        else:
            skip_slope, break_even_slope = itl.fp8_slope_ms / (1 + overhead * sliding_share), itl.fp8_slope_ms
        intercept_delta_ms = (
            itl.break_even_tokens * (itl.bf16_slope_ms - break_even_slope)
            if itl.break_even_tokens is not None
            else reference.fp8_intercept_delta_ms
        )
        calibration = ModelCalibration(
            itl_slope=itl.bf16_slope_ms / (reference.itl_slope_ms * width),
            fp8_slope_ratio=skip_slope / itl.bf16_slope_ms / reference.fp8_slope_ratio,
            sliding_window_fp8_overhead=overhead,
            fp8_intercept_delta=intercept_delta_ms / reference.fp8_intercept_delta_ms,
        )
    ttft_gpu = gpu if gpu in profile.fp8_ttft_quad_ms else Gpu.H100
    fp8_quad = profile.fp8_ttft_quad_ms.get(ttft_gpu)
    if fp8_quad is not None:
        predicted = GPU_LATENCY[ttft_gpu].ttft_quad_ms * width * _prefill_factor(ttft_gpu)
        calibration = replace(calibration, ttft_quad=fp8_quad / predicted)
    return calibration


def latency_fit(config: SimConfig) -> LatencyFit:
    """The noise-free latency curves of a server configuration."""
    gpu = GPU_LATENCY[config.gpu]
    calibration = model_calibration(config.profile, config.gpu)
    fp8_slope_ratio = min(1.0, gpu.fp8_slope_ratio * calibration.fp8_slope_ratio)
    itl_width = 0.0
    ttft_width = 0.0
    fp8_sliding_layers = 0
    for layer in range(config.num_layers):
        fp8 = config.layer_is_fp8(layer)
        if config.is_sliding_window(layer):
            fp8_sliding_layers += fp8
            continue
        itl_width += config.layer_kv_elements * (fp8_slope_ratio if fp8 else 1.0)
        prefill = _prefill_factor(config.gpu) if fp8 else 1.0
        # FlashMLA, not FA3, runs MLA attention: no head_dim-256 two-level path there.
        slow_two_level = (
            config.layer_accumulation(layer) is Accumulation.FP8_TWO_LEVEL
            and config.head_dim >= 256
            and not config.profile.mla
            and not config.fast_head_dim_256
        )
        ttft_width += config.layer_kv_elements * prefill * (HEAD_DIM_256_TWO_LEVEL_PENALTY if slow_two_level else 1.0)
    sliding_overhead = 1.0 + calibration.sliding_window_fp8_overhead * fp8_sliding_layers / config.num_layers
    itl_width *= calibration.itl_slope * sliding_overhead
    intercept_delta_ms = gpu.fp8_intercept_delta_ms * calibration.fp8_intercept_delta if config.fp8 else 0.0
    scale = config.latency_multiplier
    return LatencyFit(
        itl_slope_ms=scale * gpu.itl_slope_ms * itl_width / REFERENCE_KV_WIDTH,
        itl_intercept_ms=scale * (gpu.itl_intercept_ms + intercept_delta_ms),
        ttft_quad_ms=scale * gpu.ttft_quad_ms * calibration.ttft_quad * ttft_width / REFERENCE_KV_WIDTH,
        ttft_linear_ms=scale * gpu.ttft_linear_ms,
        ttft_const_ms=scale * gpu.ttft_const_ms,
    )


def sample_latencies(
    fit: LatencyFit, prompt_tokens: int, output_tokens: int, concurrent: int, rng: np.random.Generator
) -> tuple[float, list[float]]:
    """TTFT and the inter-token gaps (ms) of one request, with noise and a slowdown per other running request."""
    load = 1.0 + CONCURRENCY_SLOWDOWN * max(0, concurrent - 1)
    ttft = fit.ttft_ms(prompt_tokens) * load * float(rng.lognormal(0.0, TTFT_NOISE_SIGMA))
    contexts = prompt_tokens + np.arange(1, output_tokens)
    gaps = (fit.itl_slope_ms * contexts + fit.itl_intercept_ms) * load
    gaps = gaps * rng.lognormal(0.0, ITL_NOISE_SIGMA, size=gaps.shape)
    return ttft, [float(gap) for gap in gaps]
