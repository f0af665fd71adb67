"""Prefill kernels against the float64 reference: Triton's CPU interpreter without a GPU, compiled on a GPU.

The interpreter computes the kernels' arithmetic exactly but casts to FP8 by truncation (a GPU rounds to nearest),
so FP8 results there carry a ~1% downward bias; zero-mean V keeps the tolerance far below what a wrong mask, a wrong
head mapping or a lost tile costs (errors of order 1).
"""

import pytest
import torch
from kvkernels.modes import AccumulationMode
from kvkernels.prefill import attention_prefill, tokens_contiguous
from kvkernels.quant import quantize_fp8
from kvkernels.reference import attention_reference, row_errors

FP8_TOLERANCE = 6e-2
FP16_TOLERANCE = 2e-3


def _inputs(device: str, batch: int, hq: int, hk: int, lq: int, lk: int, head_dim: int, v_mean: float = 0.0):
    gen = torch.Generator(device=device).manual_seed(lq * 1000 + lk + head_dim)
    q = torch.randn(batch, hq, lq, head_dim, device=device, generator=gen)
    k = torch.randn(batch, hk, lk, head_dim, device=device, generator=gen)
    v = torch.randn(batch, hk, lk, head_dim, device=device, generator=gen) + v_mean
    return q, k, v


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", list(AccumulationMode))
@pytest.mark.parametrize(
    ("lq", "lk"),
    [
        (37, 53),  # not multiples of any tile: masked tail loop
        (32, 48),  # whole 16-wide interpreter tiles: two-level at head_dim 256 takes the causal diagonal as one tile
    ],
)
def test_fp8_prefill_matches_reference(
    device: str, head_dim: int, causal: bool, mode: AccumulationMode, lq: int, lk: int
) -> None:
    # GQA 4/2, fewer queries than keys (a chunk at the end of a longer prompt).
    q, k, v = _inputs(device, batch=2, hq=4, hk=2, lq=lq, lk=lk, head_dim=head_dim)
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    out = attention_prefill(
        q8, k8, v8, causal=causal, mode=mode, q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=torch.float32
    )
    ref = attention_reference(q8, k8, v8, causal=causal, q_scale=qs, k_scale=ks, v_scale=vs)
    error, _ = row_errors(out, ref)
    assert error < FP8_TOLERANCE
    wrong_mask, _ = row_errors(
        out, attention_reference(q8, k8, v8, causal=not causal, q_scale=qs, k_scale=ks, v_scale=vs)
    )
    assert wrong_mask > 3 * FP8_TOLERANCE  # the tolerance can tell a causal result from a full one


def test_fp8_prefill_keeps_non_zero_mean_values(device: str) -> None:
    q, k, v = _inputs(device, batch=1, hq=2, hk=2, lq=40, lk=70, head_dim=64, v_mean=1.0)
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    out = attention_prefill(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=torch.float32)
    error, shrink = row_errors(out, attention_reference(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs))
    assert error < 2e-2
    assert abs(shrink) < 2e-2


def test_value_layout_does_not_change_the_result(device: str) -> None:
    q, k, v = _inputs(device, batch=1, hq=2, hk=1, lq=20, lk=33, head_dim=64)
    q8, k8, v8 = (quantize_fp8(x, 0.05)[0] for x in (q, k, v))
    token_major = attention_prefill(q8, k8, tokens_contiguous(v8), out_dtype=torch.float32)
    dim_major = attention_prefill(q8, k8, v8, out_dtype=torch.float32)
    torch.testing.assert_close(token_major, dim_major)


@pytest.mark.parametrize("causal", [False, True])
def test_fp16_baseline_matches_reference(device: str, causal: bool) -> None:
    q, k, v = (x.half() for x in _inputs(device, batch=1, hq=4, hk=1, lq=29, lk=29, head_dim=64))
    out = attention_prefill(q, k, v, causal=causal, out_dtype=torch.float32)
    error, _ = row_errors(out, attention_reference(q, k, v, causal=causal))
    assert error < FP16_TOLERANCE


def test_rejects_invalid_inputs(device: str) -> None:
    q, k, v = (quantize_fp8(x, 0.05)[0] for x in _inputs(device, batch=1, hq=3, hk=2, lq=8, lk=8, head_dim=64))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_prefill(q, k, v)
    with pytest.raises(ValueError, match="share one dtype"):
        attention_prefill(q[:, :2], k, v.half())
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        attention_prefill(q[:, :2, :, :48], k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="at most as many queries"):
        attention_prefill(q[:, :2], k[:, :, :4], v[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="unknown accumulation mode"):
        attention_prefill(q[:, :2], k, v, mode="fast")
