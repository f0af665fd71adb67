"""Accumulation modes of the FP8 P·V product."""

from __future__ import annotations

import enum


class AccumulationMode(enum.StrEnum):
    """How the P·V partial products of each key tile reach the fp32 output accumulator.

    On Hopper an FP8 matrix instruction keeps only ~14 bits of its accumulator, so feeding the running output into it
    (single-level) truncates it a little on every tile and the output shrinks as the context grows.
    """

    # The running accumulator is the matrix instruction's C operand (Triton's default; reproduces the failure).
    SINGLE_LEVEL = "single-level"
    # A fresh partial per key tile, added to the fp32 accumulator on the CUDA cores (FA3's fix).
    TWO_LEVEL = "two-level"
    # Two-level, with the partial computed for each half of head_dim separately, so only half a partial is alive at a
    # time: at head_dim 256 this avoids the register spill that makes plain two-level ~2x slower.
    TWO_LEVEL_SPLIT = "two-level-split"

    @property
    def two_level(self) -> bool:
        return self is not AccumulationMode.SINGLE_LEVEL


def parse_mode(value: str | AccumulationMode) -> AccumulationMode:
    """The mode named by `value`; a clear error lists the valid names."""
    try:
        return AccumulationMode(value)
    except ValueError:
        names = ", ".join(mode.value for mode in AccumulationMode)
        raise ValueError(f"unknown accumulation mode {value!r}; use one of: {names}") from None
