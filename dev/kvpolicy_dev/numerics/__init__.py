"""Numerics of FP8 attention: a CPU emulator of tensor-core P·V accumulation (see `accumulation`)."""

from kvpolicy_dev.numerics.accumulation import (
    HOPPER,
    Accumulation,
    MmaModel,
    attention_row,
    quantize,
    reference_attention,
)
from kvpolicy_dev.numerics.probe import AttentionError, attention_error

__all__ = [
    "HOPPER",
    "Accumulation",
    "AttentionError",
    "MmaModel",
    "attention_error",
    "attention_row",
    "quantize",
    "reference_attention",
]
