"""vLLM's own FlashAttention-3 as a benchmark peer, called the way vLLM's FLASH_ATTN backend calls it.

Importable only where `vllm.vllm_flash_attn` is (a vLLM install, or kernels/tools/prepare_fa3.py's stand-in).
Prefill: one sequence through `flash_attn_varlen_func` with cu_seqlens. Decode: one query token per sequence over the
paged cache (block_table + seqused_k, causal=True as vLLM passes it), with the FP8 descales of shape
(sequences, KV heads) that vLLM passes; timed both with FA3's own split heuristic (num_splits=0) and with the
scheduler metadata vLLM precomputes when it captures CUDA graphs, the faster of the two being FA3's figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from kvkernels.decode import PagedKVCache
from kvkernels.quant import FP8_DTYPE


def available() -> tuple[bool, str]:
    """(True, version note) when vLLM's FA3 can run on this GPU, else (False, why not)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa  # type: ignore[import-not-found, unused-ignore]
    except ImportError as error:
        return False, f"vllm.vllm_flash_attn is not importable: {error}"
    if not fa.is_fa_version_supported(3):
        return False, f"FA3 unsupported here: {fa.fa_version_unsupported_reason(3)}"
    return True, f"vllm.vllm_flash_attn from {fa.__file__}"


def _varlen() -> Callable[..., Any]:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func  # type: ignore[no-any-return, unused-ignore]


def _descales(batch: int, kv_heads: int, scales: tuple[float, float, float], device: torch.device) -> dict[str, Any]:
    names = ("q_descale", "k_descale", "v_descale")
    return {
        n: torch.full((batch, kv_heads), s, dtype=torch.float32, device=device)
        for n, s in zip(names, scales, strict=True)
    }


def prefill_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Callable[[], torch.Tensor]:
    """A call of FA3 prefill on q [1, Hq, Lq, D], k and v [1, Hkv, Lk, D] (layouts converted once, outside)."""
    seq_q, seq_k, kv_heads = q.shape[2], k.shape[2], k.shape[1]
    qv, kv, vv = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    cu_q = torch.tensor([0, seq_q], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, seq_k], dtype=torch.int32, device=q.device)
    extra = _descales(1, kv_heads, scales, q.device) if q.dtype == FP8_DTYPE else {}
    return partial(
        _varlen(), qv, kv, vv, max_seqlen_q=seq_q, cu_seqlens_q=cu_q, max_seqlen_k=seq_k, cu_seqlens_k=cu_k,
        causal=causal, fa_version=3, **extra,
    )  # fmt: skip


def prefill_output(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """FA3's [Lq, Hq, D] output as [1, Hq, Lq, D] float32, to compare with the reference."""
    return fn().float().transpose(0, 1)[None]


def decode_fns(
    q: torch.Tensor,
    cache: PagedKVCache,
    max_seq_len: int,
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
    fixed_splits: Sequence[int] = (),
) -> dict[str, Callable[[], torch.Tensor]]:
    """FA3 decode calls, {"fa3-heuristic": ..., "fa3-scheduled": ..., "fa3-splits-N": ... for N in fixed_splits},
    each returning [sequences, Hq, D]; the last ones force FA3's split-KV count (`num_splits=N`)."""
    from vllm.vllm_flash_attn import get_scheduler_metadata

    seqs, heads, head_dim = q.shape
    page_size, kv_heads = cache.key_cache.shape[1], cache.key_cache.shape[2]
    cu_q = torch.arange(seqs + 1, dtype=torch.int32, device=q.device)
    extra = _descales(seqs, kv_heads, scales, q.device) if q.dtype == FP8_DTYPE else {}
    common = dict(
        max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=max_seq_len, seqused_k=cache.seq_lens,
        block_table=cache.block_table, causal=True, softmax_scale=1.0 / math.sqrt(head_dim), fa_version=3, **extra,
    )  # fmt: skip
    metadata = get_scheduler_metadata(
        seqs, 1, max_seq_len, heads, kv_heads, head_dim, cache.seq_lens, qkv_dtype=q.dtype, cu_seqlens_q=cu_q,
        page_size=page_size, causal=True,
    )  # fmt: skip
    varlen = _varlen()
    fns = {
        "fa3-heuristic": partial(varlen, q, cache.key_cache, cache.value_cache, **common),
        "fa3-scheduled": partial(varlen, q, cache.key_cache, cache.value_cache, scheduler_metadata=metadata, **common),
    }
    for splits in fixed_splits:
        fns[f"fa3-splits-{splits}"] = partial(
            varlen, q, cache.key_cache, cache.value_cache, num_splits=splits, **common
        )
    return fns
