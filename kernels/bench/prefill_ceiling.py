"""Prefill at head_dim 128 beside FA3 FP8: what stands between our Triton kernel and 1.2x FA3 (issue 27).

    PYTHONPATH=kernels:SITE python kernels/bench/prefill_ceiling.py --out DIR

One non-causal shape (8 heads, 8,192 queries x 65,536 keys, as bench_kernels.py), FP8 e4m3. Timed: FA3 FP8 (vLLM's
build, fa3_peer.py), our `attention_prefill` two-level and single-level, and stripped loops written here that bound
what a Triton kernel of this shape can reach: "products" (S = Q·K^T, P = S cast to e4m3, acc += P·V: both matrix
products and nothing else, i.e. the ceiling with a free softmax) and "softmax" (the same loop with the online softmax
of our kernel, two-level); each with plain pointer loads (ours) or TMA tensor descriptors (FA3's loads), and with
Triton's warp specialization of the key loop (`tl.range(..., warp_specialize=True)`, where this Triton supports it
for the target). If even "products" stays under 1.2x FA3, no scheduling of the softmax (FA3's ping-pong of two warp
groups) can reach the target in Triton; if "products" clears it and "softmax" does not, the softmax's place in the
pipeline is what is missing. Writes DIR/prefill_ceiling.json.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import fa3_peer
import torch
import triton
import triton.language as tl
from bench_kernels import environment
from kvkernels.modes import AccumulationMode
from kvkernels.prefill import LOG2_E, TileConfig, attention_prefill, tokens_contiguous
from kvkernels.quant import FP8_DTYPE, FP8_MAX

HEADS, SEQ_Q, SEQ_K, HEAD_DIM = 8, 8192, 65536, 128
FLOPS = 4.0 * HEADS * SEQ_Q * SEQ_K * HEAD_DIM
P_LOG2_SCALE = math.log2(FP8_MAX)


@triton.jit
def _step(q, kt, v, acc, m_i, l_i, qk_scale, SOFTMAX: tl.constexpr, P_SCALE: tl.constexpr):
    s = tl.dot(q, kt)
    if SOFTMAX:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - (m_new - P_SCALE)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    else:
        acc = acc + tl.dot(s.to(v.dtype), v)
    return acc, m_i, l_i


@triton.jit
def _load_kv(k_desc, v_desc, K, V, kv_head, start, seq_k, offs_n, offs_d, HEAD_DIM: tl.constexpr, DESC: tl.constexpr):
    if DESC:
        kt = k_desc.load([kv_head * seq_k + start, 0]).T
        v = v_desc.load([kv_head * HEAD_DIM, start]).T
    else:
        kt = tl.load(K + (kv_head * seq_k + start + offs_n)[None, :] * HEAD_DIM + offs_d[:, None])
        v = tl.load(V + (kv_head * HEAD_DIM + offs_d)[None, :] * seq_k + (start + offs_n)[:, None])
    return kt, v


@triton.jit
def ceiling_kernel(
    q_desc,
    k_desc,
    v_desc,
    Q,
    K,
    V,
    Out,
    qk_scale,
    seq_q,
    seq_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SOFTMAX: tl.constexpr,
    DESC: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    P_SCALE: tl.constexpr,
):
    """One tile of BLOCK_M queries of one head (its own KV head) against every key. Q, K: [heads * L, D]; V:
    [heads * D, L] (token-contiguous, as Hopper's FP8 MMA reads it); Out [heads * Lq, D] bf16."""
    tile_m = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if DESC:
        q = q_desc.load([head * seq_q + tile_m * BLOCK_M, 0])
    else:
        q = tl.load(Q + (head * seq_q + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if WARP_SPECIALIZE:
        for start in tl.range(0, seq_k, BLOCK_N, warp_specialize=True):
            kt, v = _load_kv(k_desc, v_desc, K, V, head, start, seq_k, offs_n, offs_d, HEAD_DIM, DESC)
            acc, m_i, l_i = _step(q, kt, v, acc, m_i, l_i, qk_scale, SOFTMAX, P_SCALE)
    else:
        for start in range(0, seq_k, BLOCK_N):
            kt, v = _load_kv(k_desc, v_desc, K, V, head, start, seq_k, offs_n, offs_d, HEAD_DIM, DESC)
            acc, m_i, l_i = _step(q, kt, v, acc, m_i, l_i, qk_scale, SOFTMAX, P_SCALE)
    if SOFTMAX:
        acc = acc / l_i[:, None]
    tl.store(Out + (head * seq_q + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], acc.to(Out.dtype.element_ty))


@triton.jit
def pipelined_kernel(
    Q,
    K,
    V,
    Out,
    qk_scale,
    seq_q,
    seq_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    P_SCALE: tl.constexpr,
):
    """The "softmax" loop (pointer loads) software-pipelined by hand as FA3 does within a warpgroup: S of the next
    key tile (Q·K^T) is issued before the softmax of the current one, so that, if Triton leaves that `wgmma` in
    flight until its result is used in the next iteration, the tensor cores work while the softmax runs."""
    tile_m = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (head * seq_q + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    kt = tl.load(K + (head * seq_k + offs_n)[None, :] * HEAD_DIM + offs_d[:, None])
    s = tl.dot(q, kt)
    for start in range(BLOCK_N, seq_k + BLOCK_N, BLOCK_N):
        nxt = tl.minimum(start, seq_k - BLOCK_N)  # the last round recomputes the last tile's S, never used
        kt_next = tl.load(K + (head * seq_k + nxt + offs_n)[None, :] * HEAD_DIM + offs_d[:, None])
        v = tl.load(V + (head * HEAD_DIM + offs_d)[None, :] * seq_k + (start - BLOCK_N + offs_n)[:, None])
        s_next = tl.dot(q, kt_next)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - (m_new - P_SCALE)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        s = s_next
    acc = acc / l_i[:, None]
    tl.store(Out + (head * seq_q + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], acc.to(Out.dtype.element_ty))


# (label, block_m, block_n, warps, stages, softmax, descriptors, warp specialization[, most registers a thread])
# The second pass's nine (bench/results/2026-12-02-h200-issue27-s2-run2-prefill-ceiling.*) less "softmax ptr 64 ws",
# which aborts the process in Triton 3.6's warp-specialization pass (WSLowerToken.cpp assertion), then the fifth
# pass's launch grid of the softmax loop: copy stages, key tile, descriptors at 64 query rows.
VARIANTS = [
    ("softmax ptr 64", 64, 128, 4, 3, True, False, False),
    ("softmax ptr 128", 128, 128, 8, 3, True, False, False),
    ("products ptr 64", 64, 128, 4, 3, False, False, False),
    ("products ptr 128", 128, 128, 8, 3, False, False, False),
    ("softmax desc 128", 128, 128, 8, 3, True, True, False),
    ("products desc 128", 128, 128, 8, 3, False, True, False),
    ("softmax desc 128 ws", 128, 128, 8, 3, True, True, True),
    ("products desc 128 ws", 128, 128, 8, 3, False, True, True),
    ("softmax ptr 64 s2", 64, 128, 4, 2, True, False, False),
    ("softmax ptr 64 s4", 64, 128, 4, 4, True, False, False),
    ("softmax ptr 64 n64", 64, 64, 4, 3, True, False, False),
    ("softmax ptr 64 n64 s5", 64, 64, 4, 5, True, False, False),
    ("softmax ptr 128 s2", 128, 128, 8, 2, True, False, False),
    ("softmax ptr 128 n64", 128, 64, 8, 3, True, False, False),
    ("softmax desc 64", 64, 128, 4, 3, True, True, False),
    ("softmax desc 64 s2", 64, 128, 4, 2, True, True, False),
    ("softmax desc 128 s2", 128, 128, 8, 2, True, True, False),
    ("products desc 64", 64, 128, 4, 3, False, True, False),
    ("softmax desc 64 n64 s2", 64, 64, 4, 2, True, True, False),
    ("softmax desc 64 n64 s3", 64, 64, 4, 3, True, True, False),
    ("softmax desc 64 n64 s4", 64, 64, 4, 4, True, True, False),
    ("softmax desc 64 s2 regs 168", 64, 128, 4, 2, True, True, False, 168),
    ("softmax desc 64 s2 regs 128", 64, 128, 4, 2, True, True, False, 128),
    ("softmax desc 64 n64 s3 regs 128", 64, 64, 4, 3, True, True, False, 128),
    ("softmax desc 64 ws s2", 64, 128, 4, 2, True, True, True),
    ("products desc 64 s2", 64, 128, 4, 2, False, True, False),
]
# (label, block_m, block_n, warps, stages) of the hand-pipelined softmax loop (pipelined_kernel).
PIPELINED = [
    ("pipelined ptr 64", 64, 128, 4, 3),
    ("pipelined ptr 64 s2", 64, 128, 4, 2),
    ("pipelined ptr 128", 128, 128, 8, 3),
    ("pipelined ptr 128 s2", 128, 128, 8, 2),
]


def bench_ms(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"env": environment(), "shape": [HEADS, SEQ_Q, SEQ_K, HEAD_DIM]}
    gen = torch.Generator(device="cuda").manual_seed(128)
    q = torch.randn(1, HEADS, SEQ_Q, HEAD_DIM, device="cuda", generator=gen).to(FP8_DTYPE)
    k = torch.randn(1, HEADS, SEQ_K, HEAD_DIM, device="cuda", generator=gen).to(FP8_DTYPE)
    v = (torch.randn(1, HEADS, SEQ_K, HEAD_DIM, device="cuda", generator=gen) + 1.0).to(FP8_DTYPE)
    v_tc = tokens_contiguous(v)
    results: dict[str, Any] = {}

    def record(label: str, fn: Any) -> None:
        try:
            ms = bench_ms(fn)
            results[label] = {"ms": ms, "tflops": FLOPS / ms / 1e9}
        except Exception as error:  # recorded: e.g. warp specialization this Triton cannot do for sm_90
            results[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(label, results[label], flush=True)
        data["results"] = results
        (args.out / "prefill_ceiling.json").write_text(json.dumps(data, indent=1))

    with_fa3, note = fa3_peer.available()
    data["fa3"] = note
    if with_fa3:
        record("fa3 fp8", fa3_peer.prefill_fn(q, k, v.contiguous(), False))
    for mode in (AccumulationMode.TWO_LEVEL, AccumulationMode.SINGLE_LEVEL):
        record(f"ours {mode.value}", partial(attention_prefill, q, k, v_tc, causal=False, mode=mode))
    for tile in (TileConfig(64, 128, 4, 2), TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 3)):
        label = f"ours two-level {tile.block_m}x{tile.block_n} s{tile.num_stages}"
        record(label, partial(attention_prefill, q, k, v_tc, causal=False, config=tile))
    reference = attention_prefill(q, k, v_tc, causal=False).float()

    q2 = q.view(HEADS * SEQ_Q, HEAD_DIM)
    k2 = k.view(HEADS * SEQ_K, HEAD_DIM)
    vt = v.transpose(-1, -2).contiguous().view(HEADS * HEAD_DIM, SEQ_K)  # [heads * D, tokens]
    out = torch.empty(HEADS * SEQ_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    qk_scale = LOG2_E / math.sqrt(HEAD_DIM)
    for label, block_m, block_n, warps, stages, softmax, desc, ws, *max_registers in VARIANTS:
        registers = {"maxnreg": max_registers[0]} if max_registers else {}
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor

            q_desc = TensorDescriptor.from_tensor(q2, [block_m, HEAD_DIM])
            k_desc = TensorDescriptor.from_tensor(k2, [block_n, HEAD_DIM])
            v_desc = TensorDescriptor.from_tensor(vt, [HEAD_DIM, block_n])
        except Exception as error:  # recorded: a Triton without host-side descriptors
            results[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        fn = partial(
            ceiling_kernel[(SEQ_Q // block_m, HEADS)], q_desc, k_desc, v_desc, q2, k2, vt, out, qk_scale, SEQ_Q,
            SEQ_K, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, SOFTMAX=softmax, DESC=desc,
            WARP_SPECIALIZE=ws, P_SCALE=P_LOG2_SCALE, num_warps=warps, num_stages=stages, **registers,
        )  # fmt: skip
        record(label, fn)
        if softmax and "error" not in results[label]:
            got = out.float().view(1, HEADS, SEQ_Q, HEAD_DIM)
            results[label]["relDiffToOurs"] = float((got - reference).norm() / reference.norm())
    for label, block_m, block_n, warps, stages in PIPELINED:
        fn = partial(
            pipelined_kernel[(SEQ_Q // block_m, HEADS)], q2, k2, vt, out, qk_scale, SEQ_Q, SEQ_K, BLOCK_M=block_m,
            BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, P_SCALE=P_LOG2_SCALE, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        record(label, fn)
        if "error" not in results[label]:
            got = out.float().view(1, HEADS, SEQ_Q, HEAD_DIM)
            results[label]["relDiffToOurs"] = float((got - reference).norm() / reference.norm())
    if "fa3 fp8" in results and "ms" in results["fa3 fp8"]:
        for entry in results.values():
            if "ms" in entry:
                entry["vsFa3"] = results["fa3 fp8"]["ms"] / entry["ms"]
    data["results"] = results
    (args.out / "prefill_ceiling.json").write_text(json.dumps(data, indent=1))
    for label, entry in results.items():
        print(f"| {label} | {entry.get('tflops', float('nan')):.0f} | {entry.get('vsFa3', float('nan')):.2f}x |")


if __name__ == "__main__":
    main()
