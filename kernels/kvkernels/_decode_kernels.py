"""Triton split-KV (flash-decoding) kernels over a paged KV cache. Imports only Triton."""

import triton
import triton.language as tl


@triton.jit
def paged_decode_partial_kernel(
    Q,
    KCache,
    VCache,
    BlockTable,
    SeqLens,
    PartAcc,
    PartMax,
    PartSum,
    qk_scale,
    group,
    tokens_per_split,
    s_qs,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    s_bt,
    s_as,
    s_ah,
    s_ap,
    s_ms,
    s_mh,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    UPCAST_K: tl.constexpr,
    UPCAST_V: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr,
):
    """Partial attention of one sequence's query heads that share one KV head, over one slice of its tokens.

    Grid: (sequences, KV heads, splits). The GQA group is the M dimension of the matrix products (padded to
    GROUP_PAD rows), so each cache byte is read once per group. Writes the unnormalised output, running max and
    running sum (scaled like the prefill kernel's) for the reduce kernel.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * group + offs_g
    head_ok = offs_g < group
    q = tl.load(Q + seq.to(tl.int64) * s_qs + heads[:, None] * s_qh + offs_d[None, :], mask=head_ok[:, None], other=0.0)
    if UPCAST_K:
        q = q.to(tl.bfloat16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = BlockTable + seq.to(tl.int64) * s_bt
    k_head = KCache + kv_head.to(tl.int64) * s_kh
    v_head = VCache + kv_head.to(tl.int64) * s_vh
    for tile in range(start, end, BLOCK_N):
        toks = tile + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        page = tl.load(table + toks // PAGE_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = toks % PAGE_SIZE
        kt_ptrs = k_head + page[None, :] * s_kb + slot[None, :] * s_kt + offs_d[:, None]
        kt = tl.load(kt_ptrs, mask=tok_ok[None, :], other=0.0)
        if UPCAST_K:
            # bf16 products from the FP8 cache: mma.sync's 8-bit operand layouts need shuffles that bf16's do not.
            kt = kt.to(tl.bfloat16)
        s = tl.where(tok_ok[None, :], tl.dot(q, kt), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - (m_new - P_LOG2_SCALE)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        v_ptrs = v_head + page[:, None] * s_vb + slot[:, None] * s_vt + offs_d[None, :]
        v = tl.load(v_ptrs, mask=tok_ok[:, None], other=0.0)
        if UPCAST_V:
            v = v.to(tl.bfloat16)
        p = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v) if TWO_LEVEL else tl.dot(p, v, acc * alpha[:, None])
    part = seq.to(tl.int64) * s_as + heads[:, None] * s_ah + split * s_ap + offs_d[None, :]
    tl.store(PartAcc + part, acc, mask=head_ok[:, None])
    stats = seq.to(tl.int64) * s_ms + heads * s_mh + split
    tl.store(PartMax + stats, m_i, mask=head_ok)
    tl.store(PartSum + stats, l_i, mask=head_ok)


@triton.jit
def paged_decode_reduce_kernel(
    PartAcc,
    PartMax,
    PartSum,
    PartIndex,
    Out,
    out_scale,
    num_splits,
    s_as,
    s_ah,
    s_ap,
    s_ms,
    s_mh,
    s_os,
    s_oh,
    BLOCK_D: tl.constexpr,
    SPLITS_BLOCK: tl.constexpr,
    INDEXED: tl.constexpr,
):
    """Combines the splits of one (sequence, query head) for BLOCK_D output columns. Grid: (sequences, query heads,
    head_dim / BLOCK_D). INDEXED: the sequence's partials are rows [first, first + count) of [heads, rows, ...]
    buffers, (first, count) read from PartIndex[seq] (the CUDA kernel plans splits per sequence on the device);
    else rows [0, num_splits) of the sequence's own [seqs, heads, splits, ...] slice. One pass, SPLITS_BLOCK splits
    at a time, each split weighed by exp2(its max - the running max) and the sums so far rescaled when that max
    grows: a chunk's maxima, sums and partials are loaded together, so a sequence whose splits fit one chunk (the
    caller sizes it so) costs one round trip to memory; the two-pass form (maxima first) cost two, plus one per
    32 splits, ~5 us of a 34 us decode step at 1 x 32k on an H200 (BENCHMARKS.md)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if INDEXED:
        first = tl.load(PartIndex + 2 * seq)
        count = tl.load(PartIndex + 2 * seq + 1)
        stats_base = head * s_mh + first
        acc_base = head * s_ah + first.to(tl.int64) * s_ap
    else:
        count = num_splits
        stats_base = seq * s_ms + head * s_mh
        acc_base = seq * s_as + head * s_ah
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    stats = PartMax + stats_base
    sums = PartSum + stats_base
    parts = PartAcc + acc_base + offs_d[None, :]
    offs_p = tl.arange(0, SPLITS_BLOCK)
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, count, SPLITS_BLOCK):
        split = start + offs_p
        ok = split < count
        # A split past the end of a short sequence saw no token: max -inf, weight 0.
        m = tl.load(stats + split, mask=ok, other=float("-inf"))
        s = tl.load(sums + split, mask=ok, other=0.0)
        part = tl.load(parts + split[:, None] * s_ap, mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        rescale = tl.where(m_run > float("-inf"), tl.math.exp2(m_run - m_new), 0.0)
        weight = tl.where(m > float("-inf"), tl.math.exp2(m - m_new), 0.0)
        acc = acc * rescale + tl.sum(part * weight[:, None], 0)
        l_run = l_run * rescale + tl.sum(s * weight, 0)
        m_run = m_new
    out = acc * (out_scale / l_run)
    tl.store(Out + seq * s_os + head * s_oh + offs_d, out.to(Out.dtype.element_ty))
