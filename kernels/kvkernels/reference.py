"""Float64 reference implementations (torch) of the attention the kernels compute."""

from __future__ import annotations

import math

import torch


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v in float64 for q [B, Hq, Lq, D] and k, v [B, Hkv, Lk, D] (GQA when Hq > Hkv).

    Inputs may be FP8: they are dequantised with their per-tensor scales first. Causal masking is aligned to the
    bottom right (query i sees keys j <= i + Lk - Lq), as for a chunk of a longer prompt.
    """
    _check_gqa(q.shape[1], k.shape[1])
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs at most as many queries ({q.shape[2]}) as keys ({k.shape[2]})")
    group = q.shape[1] // k.shape[1]
    qd = q.to(torch.float64) * q_scale
    kd = (k.to(torch.float64) * k_scale).repeat_interleave(group, dim=1)
    vd = (v.to(torch.float64) * v_scale).repeat_interleave(group, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = qd @ kd.transpose(-1, -2) * scale
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        cols = torch.arange(lk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return torch.softmax(scores, dim=-1) @ vd


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence from a paged cache [num_blocks, page, Hkv, D], as [Hkv, L, D]."""
    page_size = cache.shape[1]
    pages = -(-seq_len // page_size)
    tokens = cache[block_table[:pages].long()].reshape(pages * page_size, *cache.shape[2:])
    return tokens[:seq_len].transpose(0, 1)


def paged_decode_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One decode step in float64: q [S, Hq, D] against each sequence's cached keys and values, [S, Hq, D] out."""
    outputs = []
    kv_heads, head_dim = key_cache.shape[2], q.shape[2]
    _check_gqa(q.shape[1], kv_heads)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        k = gather_paged(key_cache, block_table[seq], seq_len)[None]
        v = gather_paged(value_cache, block_table[seq], seq_len)[None]
        # The query heads of one KV head as that head's query rows: the same attention without repeating K and V
        # per query head (a 256k-token sequence stays a few GB in float64).
        out = attention_reference(
            q[seq].reshape(1, kv_heads, -1, head_dim),
            k,
            v,
            softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim),
            q_scale=q_scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        outputs.append(out[0].reshape(q.shape[1], head_dim))
    return torch.stack(outputs)


def value_spread(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one decode step (as `paged_decode_reference`, default softmax scale), per (sequence, query head) in float64
    on the CPU: Σ w‖v‖ / Σ w and max ‖v‖ / Σ w, with w the softmax weights relative to the largest (max w = 1).

    Error bounds are made of them: when a kernel's probabilities carry a relative rounding error of at most u (and an
    absolute one of at most e), while its row sum does not, its output is off by at most u Σw‖v‖/Σw + n e max‖v‖/Σw.
    """
    group = q.shape[1] // key_cache.shape[2]
    spread = torch.empty(q.shape[:2], dtype=torch.float64)
    largest = torch.empty(q.shape[:2], dtype=torch.float64)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        k = gather_paged(key_cache, block_table[seq], seq_len).double().cpu().repeat_interleave(group, 0) * k_scale
        v = gather_paged(value_cache, block_table[seq], seq_len).double().cpu().repeat_interleave(group, 0) * v_scale
        scores = torch.einsum("hd,hnd->hn", q[seq].double().cpu() * q_scale, k) / math.sqrt(q.shape[2])
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        v_norm = v.norm(dim=-1)
        spread[seq] = (weights * v_norm).sum(-1) / weights.sum(-1)
        largest[seq] = v_norm.amax(-1) / weights.sum(-1)
    return spread, largest


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(mean over rows of ‖out − ref‖ / ‖ref‖, mean over rows of ‖out‖ / ‖ref‖ − 1): error and signed shrink."""
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    ref_norm = ref64.norm(dim=-1)
    rel_error = ((out64 - ref64).norm(dim=-1) / ref_norm).mean()
    shrink = (out64.norm(dim=-1) / ref_norm - 1.0).mean()
    return float(rel_error), float(shrink)


def _check_gqa(query_heads: int, kv_heads: int) -> None:
    if kv_heads <= 0 or query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of key/value heads ({kv_heads})")
