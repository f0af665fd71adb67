"""Triton prefill kernels (flash-attention forward). Imports only Triton, so they can be compiled ahead of time."""

import triton
import triton.language as tl


@triton.jit
def _kv_range(tile_m, seq_k, causal_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys [0, full_end) need no mask for any row of the tile; keys [full_end, end) are masked.

    A second, masked loop costs registers even when it runs no tile, so the caller compiles it in only when needed
    (MASK_TAIL: causal, or a key length that is not a multiple of BLOCK_N). When the causal diagonal falls inside
    one key tile (DIAGONAL_TILE), that tile is processed once, outside any loop, which spills far less.
    """
    if CAUSAL:
        # The first row of the tile sees keys up to tile_m * BLOCK_M + causal_shift; the last row a tile further.
        seen_by_all = tl.minimum(tile_m * BLOCK_M + causal_shift + 1, seq_k)
        end = tl.minimum((tile_m + 1) * BLOCK_M + causal_shift, seq_k)
    else:
        seen_by_all = seq_k
        end = seq_k
    full_end = (seen_by_all // BLOCK_N) * BLOCK_N
    return full_end, end


@triton.jit
def _softmax_step(
    q,
    kt,
    qk_scale,
    m_i,
    l_i,
    offs_m,
    offs_n,
    seq_k,
    causal_shift,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr,
):
    """One online-softmax step over a key tile: (p, alpha, m_new, l_new).

    p is multiplied by 2**P_LOG2_SCALE (448 for e4m3) before the caller casts it, so probabilities down to ~1e-5 of
    the row maximum survive the FP8 cast instead of flushing to zero; l carries the same factor, which cancels.
    qk_scale folds the softmax scale, log2(e) and the q and k dequantisation scales.
    """
    s = tl.dot(q, kt)
    if MASKED:
        keep = offs_n[None, :] < seq_k
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - (m_new - P_LOG2_SCALE)[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _tile(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    s_kn,
    s_vn,
    s_vd,
    qk_scale,
    offs_m,
    offs_d,
    start,
    seq_k,
    causal_shift,
    BLOCK_N: tl.constexpr,
    MASK_LOADS: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr,
):
    """One key tile: scores, online softmax, P·V. MASK_LOADS guards reads past seq_k; MASKED masks the scores."""
    offs_n = start + tl.arange(0, BLOCK_N)
    kt_ptrs = k_base + offs_n[None, :] * s_kn + offs_d[:, None]
    v_ptrs = v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd
    kt = tl.load(kt_ptrs, mask=offs_n[None, :] < seq_k, other=0.0) if MASK_LOADS else tl.load(kt_ptrs)
    p, alpha, m_i, l_i = _softmax_step(
        q, kt, qk_scale, m_i, l_i, offs_m, offs_n, seq_k, causal_shift, MASKED, CAUSAL, P_LOG2_SCALE
    )
    v = tl.load(v_ptrs, mask=offs_n[:, None] < seq_k, other=0.0) if MASK_LOADS else tl.load(v_ptrs)
    p = p.to(v.dtype)
    # Two-level: a fresh fp32 partial per tile, added on the CUDA cores; single-level feeds acc to the MMA.
    acc = acc * alpha[:, None] + tl.dot(p, v) if TWO_LEVEL else tl.dot(p, v, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def _prefill_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    s_kn,
    s_vn,
    s_vd,
    qk_scale,
    offs_m,
    offs_d,
    lo,
    hi,
    seq_k,
    causal_shift,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr,
):
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _tile(
            acc, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d, start, seq_k, causal_shift,
            BLOCK_N, MASKED, MASKED, CAUSAL, TWO_LEVEL, P_LOG2_SCALE,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _tile_split(
    acc_lo,
    acc_hi,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    s_kn,
    s_vn,
    s_vd,
    qk_scale,
    offs_m,
    offs_d,
    start,
    seq_k,
    causal_shift,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK_LOADS: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr,
):
    """One key tile, two-level, with the P·V partial computed for each half of head_dim in turn."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_half = tl.arange(0, HALF)
    offs_n = start + tl.arange(0, BLOCK_N)
    kt_ptrs = k_base + offs_n[None, :] * s_kn + offs_d[:, None]
    v_lo_ptrs = v_base + offs_n[:, None] * s_vn + offs_half[None, :] * s_vd
    v_hi_ptrs = v_lo_ptrs + HALF * s_vd
    kt = tl.load(kt_ptrs, mask=offs_n[None, :] < seq_k, other=0.0) if MASK_LOADS else tl.load(kt_ptrs)
    p, alpha, m_i, l_i = _softmax_step(
        q, kt, qk_scale, m_i, l_i, offs_m, offs_n, seq_k, causal_shift, MASKED, CAUSAL, P_LOG2_SCALE
    )
    v_lo = tl.load(v_lo_ptrs, mask=offs_n[:, None] < seq_k, other=0.0) if MASK_LOADS else tl.load(v_lo_ptrs)
    p = p.to(v_lo.dtype)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo)
    v_hi = tl.load(v_hi_ptrs, mask=offs_n[:, None] < seq_k, other=0.0) if MASK_LOADS else tl.load(v_hi_ptrs)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi)
    return acc_lo, acc_hi, m_i, l_i


@triton.jit
def _prefill_tiles_split(
    acc_lo,
    acc_hi,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    s_kn,
    s_vn,
    s_vd,
    qk_scale,
    offs_m,
    offs_d,
    lo,
    hi,
    seq_k,
    causal_shift,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr,
):
    for start in range(lo, hi, BLOCK_N):
        acc_lo, acc_hi, m_i, l_i = _tile_split(
            acc_lo, acc_hi, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d, start, seq_k,
            causal_shift, BLOCK_N, HEAD_DIM, MASKED, MASKED, CAUSAL, P_LOG2_SCALE,
        )  # fmt: skip
    return acc_lo, acc_hi, m_i, l_i


@triton.jit
def prefill_kernel(
    Q,
    K,
    V,
    Out,
    qk_scale,
    out_scale,
    seq_q,
    seq_k,
    causal_shift,
    num_heads,
    group,
    s_qb,
    s_qh,
    s_qm,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    s_vd,
    s_ob,
    s_oh,
    s_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    SPLIT_D: tl.constexpr,
    MASK_TAIL: tl.constexpr,
    DIAGONAL_TILE: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr,
):
    """One tile of BLOCK_M queries of one head against all the keys it may see. Grid: (query tiles, batch × heads)."""
    # Causal tiles near the end of the sequence do the most work: start them first.
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = (batch_head // num_heads).to(tl.int64)
    head = batch_head % num_heads
    kv_head = (head // group).to(tl.int64)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # Rows past the end re-read the last query instead of a masked load (which costs registers); never stored.
    q_rows = tl.minimum(offs_m, seq_q - 1)
    q = tl.load(Q + batch * s_qb + head.to(tl.int64) * s_qh + q_rows[:, None] * s_qm + offs_d[None, :])
    k_base = K + batch * s_kb + kv_head * s_kh
    v_base = V + batch * s_vb + kv_head * s_vh
    full_end, end = _kv_range(tile_m, seq_k, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SPLIT_D:
        HALF: tl.constexpr = HEAD_DIM // 2
        acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc_lo, acc_hi, m_i, l_i = _prefill_tiles_split(
            acc_lo, acc_hi, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d,
            0, full_end, seq_k, causal_shift, BLOCK_N, HEAD_DIM, False, CAUSAL, P_LOG2_SCALE,
        )  # fmt: skip
        if DIAGONAL_TILE:
            acc_lo, acc_hi, m_i, l_i = _tile_split(
                acc_lo, acc_hi, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d,
                full_end, seq_k, causal_shift, BLOCK_N, HEAD_DIM, False, True, CAUSAL, P_LOG2_SCALE,
            )  # fmt: skip
        elif MASK_TAIL:
            acc_lo, acc_hi, m_i, l_i = _prefill_tiles_split(
                acc_lo, acc_hi, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d,
                full_end, end, seq_k, causal_shift, BLOCK_N, HEAD_DIM, True, CAUSAL, P_LOG2_SCALE,
            )  # fmt: skip
        out_base = Out + batch * s_ob + head.to(tl.int64) * s_oh + offs_m[:, None] * s_om
        row_ok = offs_m[:, None] < seq_q
        norm = (out_scale / l_i)[:, None]
        offs_half = tl.arange(0, HALF)
        tl.store(out_base + offs_half[None, :], (acc_lo * norm).to(Out.dtype.element_ty), mask=row_ok)
        tl.store(out_base + HALF + offs_half[None, :], (acc_hi * norm).to(Out.dtype.element_ty), mask=row_ok)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d,
            0, full_end, seq_k, causal_shift, BLOCK_N, False, CAUSAL, TWO_LEVEL, P_LOG2_SCALE,
        )  # fmt: skip
        if DIAGONAL_TILE:
            acc, m_i, l_i = _tile(
                acc, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d,
                full_end, seq_k, causal_shift, BLOCK_N, False, True, CAUSAL, TWO_LEVEL, P_LOG2_SCALE,
            )  # fmt: skip
        elif MASK_TAIL:
            acc, m_i, l_i = _prefill_tiles(
                acc, m_i, l_i, q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_d,
                full_end, end, seq_k, causal_shift, BLOCK_N, True, CAUSAL, TWO_LEVEL, P_LOG2_SCALE,
            )  # fmt: skip
        acc = acc * (out_scale / l_i)[:, None]
        out_base = Out + batch * s_ob + head.to(tl.int64) * s_oh + offs_m[:, None] * s_om
        row_ok = offs_m[:, None] < seq_q
        tl.store(out_base + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=row_ok)
