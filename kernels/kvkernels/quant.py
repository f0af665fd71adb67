"""Per-tensor FP8 (e4m3) quantisation, as vLLM applies it to the KV cache and the query."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def per_tensor_scale(x: torch.Tensor) -> float:
    """The scale that maps the largest magnitude of `x` onto the largest e4m3 value (1.0 for an all-zero tensor)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax / FP8_MAX if amax > 0.0 else 1.0


def quantize_fp8(x: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, float]:
    """`x / scale` cast to e4m3 and the scale used; `x ≈ result.float() * scale`."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_fp8 needs a floating-point tensor, got {x.dtype}")
    used = per_tensor_scale(x) if scale is None else float(scale)
    if not used > 0.0:
        raise ValueError(f"the FP8 scale must be positive, got {used}")
    scaled = (x.float() / used).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE), used


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """`x * scale` in `dtype` (float64 by default, for references)."""
    return x.to(dtype) * scale
