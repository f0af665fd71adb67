"""The H200 probe's measurement, run on the emulator: attention error against context length.

Same data as shared/reference/probes/fp8_accum_probe.py: q, k ~ N(0, 1) and v ~ N(0, 1) + 1 (real V rows have a
non-zero mean; with zero-mean V the shrink hides), the reference in float64 from the same cache-dtype inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpolicy_dev.numerics.accumulation import (
    HOPPER,
    Accumulation,
    MmaModel,
    attention_row,
    quantize,
    reference_attention,
)

V_MEAN = 1.0
# Keys and values are drawn from a table of this many normal samples: a gather is ~10x cheaper than drawing fresh
# normals, and quantising the table once replaces quantising the whole (length x head_dim) cache.
_TABLE_SIZE = 1 << 16


@dataclass(frozen=True)
class AttentionError:
    """Mean over query rows of ||out - ref|| / ||ref|| and of ||out|| / ||ref|| - 1 (negative: the output shrank)."""

    relative: float
    signed_shrink: float


def attention_error(
    accumulation: Accumulation,
    length: int,
    head_dim: int = 128,
    rows: int = 2,
    seed: int = 0,
    mma: MmaModel = HOPPER,
) -> AttentionError:
    """Emulate `rows` query rows against `length` keys and compare with the exact result."""
    rng = np.random.default_rng([seed, length, head_dim])
    q = rng.standard_normal((rows, head_dim), dtype=np.float32)
    normal_table = rng.standard_normal(_TABLE_SIZE, dtype=np.float32)
    k_cache = quantize(normal_table, accumulation)[rng.integers(0, _TABLE_SIZE, (length, head_dim), dtype=np.uint16)]
    v_table = quantize(normal_table + np.float32(V_MEAN), accumulation)
    v_cache = v_table[rng.integers(0, _TABLE_SIZE, (length, head_dim), dtype=np.uint16)]
    out = np.stack([attention_row(row, k_cache, v_cache, accumulation, mma) for row in q])
    ref = reference_attention(quantize(q, accumulation), k_cache, v_cache)
    ref_norm = np.linalg.norm(ref, axis=1)
    return AttentionError(
        relative=float(np.mean(np.linalg.norm(out - ref, axis=1) / ref_norm)),
        signed_shrink=float(np.mean(np.linalg.norm(out, axis=1) / ref_norm - 1.0)),
    )
