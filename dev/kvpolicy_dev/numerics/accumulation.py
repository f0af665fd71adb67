"""Emulate how attention kernels accumulate P·V, to reproduce the FP8 long-context shrink on Hopper.

Hopper's tensor cores add the products of one MMA k-step (32 elements for FP8, 16 for BF16) together with the
accumulator fed back as the C operand by aligning every term to the largest exponent among them and truncating
toward zero after a fixed number of retained bits. When the running accumulator is fed back across a long context
it grows, its exponent rises, and each new small product loses more of its low bits: the output shrinks with length.
Two-level accumulation gives every KV tile a fresh partial (so the partial stays small) and adds it in fp32.
Blackwell (and GPUs that dequantise FP8 to BF16 before the MMA) accumulate without truncation.

The calibrated constants (retained bits) reproduce the H200 measurements in
shared/reference/h200-fp8-accumulation.md; tests/numerics asserts that calibration.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]
F32 = npt.NDArray[np.float32]

_FLOAT32_EXPONENT_MASK = np.uint32(0x7F800000)
_E4M3_MAX = 448.0
# Groups solved together in the single-level path: small enough to stay in cache and settle fast.
_GROUPS_PER_CHUNK = 64
_MAX_ALIGNMENT_ITERATIONS = 8
_REFERENCE_CHUNK = 1 << 20


class Accumulation(enum.StrEnum):
    """How a kernel accumulates P·V."""

    BF16 = "bf16"
    FP8_SINGLE_LEVEL = "fp8-single-level"
    FP8_TWO_LEVEL = "fp8-two-level"
    FP8_BLACKWELL = "fp8-blackwell"

    @property
    def is_fp8(self) -> bool:
        return self is not Accumulation.BF16


@dataclass(frozen=True)
class MmaModel:
    """The tensor-core behaviour the emulator assumes; the defaults are calibrated against the H200 probe."""

    # Bits kept below (and including) the leading bit of the largest term of one FP8 k-step; DeepSeek-V3 reports
    # ~14 for H800 GEMMs, and 14 matches the measured attention shrink at 4k-256k within a few percent.
    fp8_retained_bits: int = 14
    # Hopper's BF16 MMA truncates too, far more gently: 26 bits give 6e-5 (4k) .. 9e-4 (256k); measured 5e-5 .. 1.2e-3.
    bf16_retained_bits: int = 26
    fp8_k_step: int = 32
    bf16_k_step: int = 16
    # Keys per KV tile (BLOCK_N): the unit of the online-softmax rescale and of the two-level partial.
    tile_keys: int = 128


HOPPER = MmaModel()


def quantize(x: FloatArray, accumulation: Accumulation) -> F32:
    """Round to the KV-cache dtype the accumulation mode reads (e4m3 with unit scale, or bf16), as float32 values."""
    dtype = ml_dtypes.float8_e4m3fn if accumulation.is_fp8 else ml_dtypes.bfloat16
    x32 = np.asarray(x, dtype=np.float32)
    if accumulation.is_fp8 and x32.size and np.abs(x32).max() > _E4M3_MAX:
        # e4m3fn has no infinity: values past 448 would become NaN; vLLM's cache write saturates instead.
        x32 = np.clip(x32, -_E4M3_MAX, _E4M3_MAX)
    result: F32 = x32.astype(dtype).astype(np.float32)
    return result


def _power_of_two_floor(x: F32) -> F32:
    """2**floor(log2(|x|)) for positive finite float32 x, by keeping only the exponent bits (0 stays 0)."""
    result: F32 = (x.view(np.uint32) & _FLOAT32_EXPONENT_MASK).view(np.float32)
    return result


def _truncated_group_sums(products: F32, exponent_floor: F32, retained_bits: int) -> F32:
    """Sum each group (..., K, D) after truncating every term toward zero onto its group's alignment grid."""
    # Grids are powers of two, so scaling by the reciprocal is exact; an all-zero group (padding) has grid 1.
    grid = np.where(exponent_floor > 0, exponent_floor * np.float32(2.0 ** (1 - retained_bits)), np.float32(1.0))
    scaled = products * (np.float32(1.0) / grid)[..., None, :]
    np.trunc(scaled, out=scaled)
    scaled *= grid[..., None, :]
    result: F32 = scaled.sum(axis=-2, dtype=np.float32)
    return result


def _solve_alignment(
    products: F32, product_max: F32, group_scale: F32, carried: npt.NDArray[np.float64], retained_bits: int
) -> F32:
    """Truncated sums of runs of groups (R, G, K, D) whose fed-back accumulator starts at `carried` (R, D).

    A group's alignment exponent depends on the accumulator, which depends on earlier truncations: solve by
    fixed-point iteration starting from the untruncated sums, recomputing only groups whose exponent changed.
    Over a short run of groups the accumulator barely moves, so this settles in one or two passes.
    """
    contributions: F32 = products.sum(axis=-2, dtype=np.float32)
    exponents = np.full(product_max.shape, -1.0, dtype=np.float32)
    scale = group_scale[..., None].astype(np.float64)
    for _ in range(_MAX_ALIGNMENT_ITERATIONS):
        scaled = contributions * scale
        # The accumulator before each group, in that group's running-max units (the kernel rescales it by alpha).
        before = (carried[:, None, :] + np.cumsum(scaled, axis=1) - scaled) / scale
        new_exponents = _power_of_two_floor(np.maximum(np.abs(before).astype(np.float32), product_max))
        changed = np.any(new_exponents != exponents, axis=-1)
        if not changed.any():
            break
        exponents = new_exponents
        if changed.all():  # skips the copy that boolean indexing makes
            contributions = _truncated_group_sums(products, exponents, retained_bits)
        else:
            contributions[changed] = _truncated_group_sums(products[changed], exponents[changed], retained_bits)
    return contributions


def _fed_back_accumulate(
    p_cached: F32, v_cache: F32, group_scale: F32, k_step: int, retained_bits: int, groups_per_partial: int | None
) -> npt.NDArray[np.float64]:
    """Accumulate P·V in groups of k_step keys with the accumulator fed back into each k-step; returns final units.

    `p_cached` (padded to whole groups) is in the units of each KV tile's running max; `group_scale` converts a
    group's units to the final max's units (<= 1). With `groups_per_partial` set, the fed-back accumulator restarts
    every that many groups (two-level: a fresh partial per tile, added exactly in fp32); otherwise it runs over the
    whole context. Products are formed chunk by chunk so each chunk's work stays in cache.
    """
    head_dim = v_cache.shape[1]
    run_length = groups_per_partial or _GROUPS_PER_CHUNK
    chunk = run_length * max(1, _GROUPS_PER_CHUNK // run_length) * k_step
    total = np.zeros(head_dim, dtype=np.float64)
    for start in range(0, len(p_cached), chunk):
        stop = min(start + chunk, len(p_cached))
        products = p_cached[start:stop, None] * v_cache[start:stop]
        if len(products) < stop - start:  # keys past the context, padding the last tile: no contribution
            products = np.vstack([products, np.zeros((stop - start - len(products), head_dim), dtype=np.float32)])
        groups = products.reshape(-1, k_step, head_dim)
        runs = len(groups) // groups_per_partial if groups_per_partial else 1
        carried = np.zeros((runs, head_dim)) if groups_per_partial else total[None, :]
        scale = group_scale[start // k_step : stop // k_step]
        sums = _solve_alignment(
            groups.reshape(runs, -1, k_step, head_dim),
            np.abs(groups).max(axis=1).reshape(runs, -1, head_dim),
            scale.reshape(runs, -1),
            carried,
            retained_bits,
        )
        total = total + scale.astype(np.float64) @ sums.reshape(-1, head_dim)
    return total


def attention_row(
    q: FloatArray, k_cache: F32, v_cache: F32, accumulation: Accumulation, mma: MmaModel = HOPPER
) -> npt.NDArray[np.float64]:
    """One query row of softmax(q·kᵀ/√d)·v as the kernel computes it, flash-attention style.

    `k_cache` and `v_cache` (N, D) hold values already in the cache dtype (see `quantize`); q is rounded here.
    """
    n_keys, head_dim = k_cache.shape
    tile = mma.tile_keys
    k_step = mma.bf16_k_step if accumulation is Accumulation.BF16 else mma.fp8_k_step
    padded = -(-n_keys // tile) * tile
    logits = np.full(padded, -np.inf, dtype=np.float32)
    logits[:n_keys] = (k_cache @ quantize(q, accumulation)) * np.float32(1.0 / math.sqrt(head_dim))
    # Online softmax: each tile's probabilities are taken against the running max up to that tile.
    running_max = np.maximum.accumulate(logits.reshape(-1, tile).max(axis=1))
    final_max = running_max[-1]
    probabilities = np.exp(logits.reshape(-1, tile) - running_max[:, None]).reshape(-1)
    row_sum = float(np.exp(logits[:n_keys].astype(np.float64) - final_max).sum())
    tile_scale = np.exp(running_max - final_max).astype(np.float32)
    p_cached = quantize(probabilities, accumulation)
    if accumulation is Accumulation.FP8_BLACKWELL:
        # Plain fp32 accumulation, as the hardware does without truncation; each p·v product is exact in fp32.
        weights = p_cached[:n_keys] * np.repeat(tile_scale, tile)[:n_keys]
        result: npt.NDArray[np.float64] = (weights @ v_cache).astype(np.float64) / row_sum
        return result
    group_scale = np.repeat(tile_scale, tile // k_step)
    bits = mma.bf16_retained_bits if accumulation is Accumulation.BF16 else mma.fp8_retained_bits
    per_partial = tile // k_step if accumulation is Accumulation.FP8_TWO_LEVEL else None
    return _fed_back_accumulate(p_cached, v_cache, group_scale, k_step, bits, per_partial) / row_sum


def reference_attention(q: FloatArray, k: F32, v: F32) -> npt.NDArray[np.float64]:
    """Attention for query rows q (M, D) in float64 from the softmax on (chunked, to bound memory).

    The logits come from a float32 product: for cache-dtype inputs each product is exact and a head_dim-term sum
    rounds far below the errors this reference is used to measure.
    """
    q32 = np.atleast_2d(np.asarray(q, dtype=np.float32))
    logits = (k @ q32.T).astype(np.float64) / math.sqrt(q32.shape[-1])
    weights = np.exp(logits - logits.max(axis=0))
    total = np.zeros((q32.shape[0], v.shape[1]))
    rows_per_chunk = max(1, _REFERENCE_CHUNK // v.shape[1])
    for start in range(0, v.shape[0], rows_per_chunk):
        part = slice(start, start + rows_per_chunk)
        total += weights[part].T @ v[part].astype(np.float64)
    result: npt.NDArray[np.float64] = total / weights.sum(axis=0)[:, None]
    return result
