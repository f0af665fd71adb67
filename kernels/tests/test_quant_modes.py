"""Per-tensor FP8 quantisation and accumulation-mode parsing."""

import pytest
import torch
from kvkernels.modes import AccumulationMode, parse_mode
from kvkernels.quant import FP8_DTYPE, FP8_MAX, dequantize, per_tensor_scale, quantize_fp8


def test_quantise_uses_the_whole_e4m3_range_and_round_trips() -> None:
    x = torch.randn(1000) * 3
    x8, scale = quantize_fp8(x)
    assert x8.dtype == FP8_DTYPE
    assert scale == pytest.approx(float(x.abs().max()) / FP8_MAX)
    assert float(x8.float().abs().max()) == FP8_MAX
    rel = ((dequantize(x8, scale) - x.double()).norm() / x.double().norm()).item()
    assert rel < 0.05  # e4m3 keeps 3 mantissa bits: ~2-3% per element


def test_given_scale_is_used_and_values_saturate() -> None:
    x8, scale = quantize_fp8(torch.tensor([1.0, 1e6]), scale=0.5)
    assert scale == 0.5
    assert x8.float().tolist() == [2.0, FP8_MAX]


def test_zero_tensor_gets_unit_scale() -> None:
    assert per_tensor_scale(torch.zeros(4)) == 1.0


def test_quantise_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.arange(3))
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8(torch.ones(3), scale=0.0)


def test_modes_parse_by_name() -> None:
    assert parse_mode("two-level-split") is AccumulationMode.TWO_LEVEL_SPLIT
    assert not AccumulationMode.SINGLE_LEVEL.two_level
    assert AccumulationMode.TWO_LEVEL.two_level and AccumulationMode.TWO_LEVEL_SPLIT.two_level
    with pytest.raises(ValueError, match="single-level, two-level, two-level-split"):
        parse_mode("three-level")
