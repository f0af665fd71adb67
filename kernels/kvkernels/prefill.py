"""FP8 prefill attention (flash-attention forward in Triton) with a choice of P·V accumulation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kvkernels._prefill_kernels import prefill_kernel
from kvkernels.modes import AccumulationMode, parse_mode
from kvkernels.quant import FP8_DTYPE, FP8_MAX

LOG2_E = 1.4426950408889634
SUPPORTED_DTYPES = (FP8_DTYPE, torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch parameters of one kernel variant."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Best measured for two-level on an H200 (kernels/BENCHMARKS.md), by head_dim.
_FP8_CONFIGS = {
    64: TileConfig(64, 128, 4, 3),
    128: TileConfig(64, 128, 4, 3),
    256: TileConfig(128, 128, 8, 3),
}
_BF16_CONFIGS = {
    64: TileConfig(64, 128, 4, 3),
    128: TileConfig(128, 128, 8, 3),
    256: TileConfig(128, 64, 8, 2),
}
# Small tiles for Triton's CPU interpreter, where time grows with the tile count only mildly.
INTERPRETER_CONFIG = TileConfig(16, 16, 1, 1)


def default_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> TileConfig:
    """The tile configuration used when the caller names none."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return (_FP8_CONFIGS if dtype == FP8_DTYPE else _BF16_CONFIGS)[head_dim]


def tokens_contiguous(v: torch.Tensor) -> torch.Tensor:
    """`v` [..., N, D] with the token axis contiguous in memory (same values, same shape).

    Hopper's FP8 matrix instructions read both operands K-major; for P·V the contraction runs over tokens, so FP8 V
    must be laid out token-contiguous. Callers that keep V this way avoid a copy on every call.
    """
    if v.stride(-2) == 1:
        return v
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mode: AccumulationMode | str = AccumulationMode.TWO_LEVEL,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D] (GQA when Hq > Hkv), output [B, Hq, Lq, D].

    q, k and v are FP8 e4m3 with per-tensor scales (`x ≈ x8 * scale`), or bf16/fp16 (scales 1) for a baseline of
    the same design. Lengths need not be multiples of the tile. Causal masking is aligned to the bottom right.
    """
    mode = parse_mode(mode)
    _validate(q, k, v, causal)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    fp8 = q.dtype == FP8_DTYPE
    if fp8:
        v = tokens_contiguous(v)
    cfg = config or default_config(head_dim, q.dtype, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    diagonal_tile = _diagonal_as_one_tile(causal, mode, head_dim, seq_q, seq_k, cfg)
    out = torch.empty((batch, heads, seq_q, head_dim), device=q.device, dtype=out_dtype)
    grid = (triton.cdiv(seq_q, cfg.block_m), batch * heads)
    prefill_kernel[grid](
        q, k, v, out,
        scale * q_scale * k_scale * LOG2_E, v_scale,
        seq_q, seq_k, seq_k - seq_q, heads, heads // k.shape[1],
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, CAUSAL=causal,
        TWO_LEVEL=mode.two_level, SPLIT_D=mode is AccumulationMode.TWO_LEVEL_SPLIT,
        MASK_TAIL=(causal and not diagonal_tile) or seq_k % cfg.block_n != 0, DIAGONAL_TILE=diagonal_tile,
        P_LOG2_SCALE=math.log2(FP8_MAX) if fp8 else 0.0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _diagonal_as_one_tile(
    causal: bool, mode: AccumulationMode, head_dim: int, seq_q: int, seq_k: int, cfg: TileConfig
) -> bool:
    """Whether the causal diagonal is processed as one tile outside the key loop instead of in a masked loop.

    Possible when tiles are whole and each query tile's diagonal lies in one key tile. On an H200 it paid only where
    the masked loop spills, two-level at head_dim 256 (split causal 933 -> 977 TFLOP/s), and cost 3-12% elsewhere.
    """
    aligned = cfg.block_n % cfg.block_m == 0 and (seq_k - seq_q) % cfg.block_m == 0 and seq_k % cfg.block_n == 0
    return causal and aligned and head_dim == 256 and mode.two_level


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [batch, heads, length, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k, v must share one dtype among {SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k and v must match each other and q in batch and head_dim: {q.shape}, {k.shape}, {v.shape}")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q.shape[3]} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError("query and key lengths must be at least 1")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs at most as many queries ({q.shape[2]}) as keys ({k.shape[2]})")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous along head_dim")
