"""A CPU model of the CUDA decode kernel (csrc/paged_decode_fp8.cu), the oracle of its logic in tests.

No interpreter runs CUDA C++, so this follows the .cu source step by step in torch: the launch comes from the
package's own planning (`plan_launch`); each block's work is planned from seq_lens as the kernel's `plan_work` does
(written again here, not taken from the package: the budget of whole waves, each sequence's split count, the running
sum that places a block in a sequence, idle blocks past the last); every warp of every block is one worker with the
kernel's index arithmetic (split and slice boundaries from the sequence's own length and split count, the page of
each 16-token chunk clamped to the sequence's last page, zero-filled copies past the end, the GQA head of each mma
row, the partials' row = block x slices + slice); per tile, S = Q·K^T as the kernel's mma k-steps (16 permuted head_dim
elements each, rounded to fp32 after each step), the mask, the online softmax in log2 units, P rounded to f16, a
fresh P·V partial per tile summed 16 tokens (one mma) at a time, then out = out * alpha + partial (two-level); each
lane's running sum over its own tokens, added over the quad at the end; then the reduce kernel's merge of each
sequence's rows.

The workers run side by side (tensors over all of them) and each stops after its own number of tiles. What the model
leaves out does not change a value: copy stages, shared-memory swizzle, strides, and which lane holds which bytes.
It differs from the GPU only in rounding: torch's exp2 for ex2.approx, and IEEE fp32 sums inside an mma.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvkernels._decode_mma import LaunchPlan, MmaDecodeConfig, plan_launch
from kvkernels.decode import PagedKVCache, qk_log2_scale

H200_MULTIPROCESSORS = 132
# Blocks of the default launch shape that fit on one H200 multiprocessor (the driver's occupancy query, head_dim 128
# and 256: registers allow one block of 8 warps).
H200_RESIDENT_BLOCKS = 1
MMA_K = 16  # head_dim elements of one Q·K^T mma step; tokens of one P·V mma step
QUAD = 4  # lanes that share an mma row


@dataclass(frozen=True)
class Partials:
    """What the partial kernel writes: [heads, rows, D] unnormalised outputs, [heads, rows] running max (log2 units)
    and running sum, and [seqs, 2] (first row, rows) of each sequence; rows of idle blocks stay NaN."""

    acc: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor
    index: torch.Tensor


@dataclass(frozen=True)
class Work:
    """Per block of a grid row (blockIdx.x): its sequence (-1: idle), split, the sequence's split count and first
    block."""

    seq: torch.Tensor
    split: torch.Tensor
    splits: torch.Tensor
    first: torch.Tensor


def _split_count(budget: int, seqs: int, total: int, steps: torch.Tensor) -> torch.Tensor:
    if budget <= seqs:
        return torch.ones_like(steps)
    return (1 + (budget - seqs) * steps // total).clamp(max=steps).clamp(min=1)


def plan_work(seq_lens: torch.Tensor, plan: LaunchPlan) -> Work:
    """The work of every block of a grid row (blockIdx.x): a device plan as the kernel's `plan_work` makes it; a host
    plan's blocks are sequence-major (x = sequence x splits + split: the (split, sequence) of blockIdx.x and .z)."""
    seqs = seq_lens.shape[0]
    if not plan.on_device:
        block = torch.arange(plan.grid[0] * plan.grid[2])
        splits = torch.full_like(block, plan.grid[0])
        return Work(block // plan.grid[0], block % plan.grid[0], splits, block - block % plan.grid[0])
    steps = (seq_lens + plan.tokens_per_step - 1) // plan.tokens_per_step
    total, longest = max(1, int(steps.sum())), int(steps.max())
    kv_blocks = plan.grid[1]
    budget = plan.wave // kv_blocks
    for waves in range(plan.most_waves, 0, -1):
        candidate = waves * plan.wave // kv_blocks
        if longest >= int(_split_count(candidate, seqs, total, torch.tensor([longest]))[0]) * plan.min_split_steps:
            budget = candidate
            break
    if plan.fixed_splits:
        counts = torch.full_like(steps, plan.fixed_splits)
    else:
        counts = _split_count(budget, seqs, total, steps)
    ends = counts.cumsum(0)
    block = torch.arange(plan.grid[0])
    seq = torch.searchsorted(ends, block, right=True)  # the first sequence whose splits end past the block
    idle = seq >= seqs
    seq = torch.where(idle, 0, seq)
    first = ends[seq] - counts[seq]
    return Work(torch.where(idle, -1, seq), block - first, counts[seq], first)


def qk_step_order(head_dim: int) -> torch.Tensor:
    """[K_STEPS, 16] head_dim indices of each Q·K^T mma step: lane j of a quad takes word s % 4 of its 16-byte piece
    at 64 (s // 4) + 16 j, for q and k alike."""
    return torch.tensor(
        [
            [64 * (s // 4) + 16 * j + 4 * (s % 4) + b for j in range(QUAD) for b in range(4)]
            for s in range(head_dim // MMA_K)
        ]
    )


def _fp32_add(acc: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """acc + exact with one rounding to fp32, as an mma or an fma adds."""
    return (acc.double() + exact).float()


def model_partials(
    q: torch.Tensor, cache: PagedKVCache, plan: LaunchPlan, config: MmaDecodeConfig, qk_scale: float
) -> Partials:
    """The partial kernel's outputs for this launch, computed on the CPU."""
    q, kc, vc = q.cpu(), cache.key_cache.cpu(), cache.value_cache.cpu()
    table, seq_lens = cache.block_table.cpu().long(), cache.seq_lens.cpu().long()
    seqs, heads, head_dim = q.shape
    page_size = kc.shape[1]
    tile, slices, group = config.tile, config.warps_per_head, plan.group
    qk = torch.tensor(qk_scale, dtype=torch.float32)  # passed to the kernel as a C float

    # One worker per warp of the grid's busy blocks: blockIdx = (block, KV-head block[, sequence]), warp = slice x
    # heads_in_block; the block's sequence and split from the plan.
    work = plan_work(seq_lens, plan)
    warps = plan.threads // 32
    busy = [bx for bx in range(work.seq.shape[0]) if int(work.seq[bx]) >= 0]
    ids = torch.tensor([(bx, by, w) for by in range(plan.grid[1]) for bx in busy for w in range(warps)])
    block, warp = ids[:, 0], ids[:, 2]
    seq, split, splits = work.seq[block], work.split[block], work.splits[block]
    slice_ = warp // plan.heads_in_block
    kv_head = ids[:, 1] * plan.heads_in_block + warp % plan.heads_in_block
    seq_len = seq_lens[seq]
    if plan.on_device:  # cut from the sequence's own length
        steps = (seq_len + plan.tokens_per_step - 1) // plan.tokens_per_step
        tokens_per_split = (steps + splits - 1) // splits * plan.tokens_per_step
    else:
        tokens_per_split = torch.full_like(seq_len, plan.tokens_per_split)
    per_warp = tokens_per_split // slices
    start = split * tokens_per_split + slice_ * per_warp
    end = torch.minimum(seq_len, start + per_warp)
    num_tiles = torch.where(end > start, (end - start + tile - 1) // tile, 0)
    part = block * slices + slice_
    last_page = torch.where(seq_len > 0, (seq_len - 1) // page_size, 0)
    rows = torch.arange(group)
    head = kv_head[:, None] * group + rows  # [W, G]: mma row -> query head
    q_rows = q[seq[:, None], head].float()  # e4m3 -> f16 is exact, and so is f16 -> f32
    steps = qk_step_order(head_dim)

    workers = ids.shape[0]
    out = torch.zeros(workers, group, head_dim)
    m_run = torch.full((workers, group), float("-inf"))
    l_run = torch.zeros(workers, group, QUAD)  # per lane of the quad
    tok = torch.arange(tile)
    for t in range(int(num_tiles.max())):
        active = t < num_tiles
        tile_start = start + t * tile
        # The page of each 16-token chunk, never past the sequence's last page.
        index = (tile_start[:, None] + MMA_K * torch.arange(tile // MMA_K)) // page_size
        pages = table[seq[:, None], torch.minimum(index, last_page[:, None])]
        page = pages[:, tok // MMA_K]
        row_in_page = (tile_start[:, None] + tok) % page_size
        valid = tile_start[:, None] + tok < end[:, None]  # copies past the end fill zeros, read nothing
        k = torch.where(valid[..., None], kc[page, row_in_page, kv_head[:, None]].float(), 0.0)
        v = torch.where(valid[..., None], vc[page, row_in_page, kv_head[:, None]].float(), 0.0)

        s = torch.zeros(workers, group, tile)
        for step in steps:
            s = _fp32_add(s, torch.einsum("wgd,wtd->wgt", q_rows[..., step].double(), k[..., step].double()))
        last_tile = (tile_start + tile > end)[:, None, None]  # only the last tile masks tokens past the end
        s = torch.where(last_tile & ~valid[:, None, :], float("-inf"), s)
        m_new = torch.maximum(m_run, s.amax(-1) * qk)
        alpha = torch.exp2(m_run - m_new)
        p = torch.exp2((s.double() * qk.double() - m_new.double()[..., None]).float())  # fmaf(s, qk_scale, -m_new)
        # Lane j of the quad holds tokens 8 nb + 2 j and 8 nb + 2 j + 1 of each 8-token block nb.
        lane_p = p.view(workers, group, tile // 8, QUAD, 2)
        lane_sum = torch.zeros(workers, group, QUAD)
        for nb in range(tile // 8):
            for pair in range(2):
                lane_sum = lane_sum + lane_p[:, :, nb, :, pair]
        l_new = _fp32_add(l_run.double() * alpha.double()[..., None], lane_sum.double())
        p16 = p.half().double()  # cvt.rn.f16x2.f32
        partial = torch.zeros(workers, group, head_dim)
        for c in range(tile // MMA_K):
            chunk = slice(MMA_K * c, MMA_K * (c + 1))
            partial = _fp32_add(partial, torch.einsum("wgt,wtd->wgd", p16[..., chunk], v[:, chunk].double()))
        out_new = _fp32_add(out.double() * alpha.double()[..., None], partial.double())
        live = active[:, None]
        out = torch.where(live[..., None], out_new, out)
        l_run = torch.where(live[..., None], l_new, l_run)
        m_run = torch.where(live, m_new, m_run)

    l_sum = (l_run[..., 0] + l_run[..., 1]) + (l_run[..., 2] + l_run[..., 3])  # shfl_xor 1, then 2
    acc = torch.full((heads, plan.num_parts, head_dim), float("nan"))
    run_max = torch.full((heads, plan.num_parts), float("nan"))
    run_sum = torch.full((heads, plan.num_parts), float("nan"))
    where = (head, part[:, None])
    acc[where], run_max[where], run_sum[where] = out, m_run, l_sum
    index = torch.zeros(seqs, 2, dtype=torch.int32)
    starts = (work.seq >= 0) & (work.split == 0)  # the first block of each sequence writes its rows
    index[work.seq[starts]] = torch.stack([work.first[starts] * slices, work.splits[starts] * slices], 1).int()
    return Partials(acc, run_max, run_sum, index)


def model_combine(partials: Partials, v_scale: float) -> torch.Tensor:
    """The reduce kernel: each sequence's rows, splits weighted by exp2(max - overall max), splits that saw no
    token by 0."""
    outs = []
    for first, count in partials.index.tolist():
        rows = slice(first, first + count)
        m, acc, sums = partials.max[:, rows], partials.acc[:, rows], partials.sum[:, rows]
        weight = torch.where(m > float("-inf"), torch.exp2(m - m.amax(-1, keepdim=True)), 0.0)
        scale = torch.tensor(v_scale, dtype=torch.float32) / (sums * weight).sum(-1)
        outs.append((acc * weight[..., None]).sum(-2) * scale[..., None])
    return torch.stack(outs)


def model_launch(
    q: torch.Tensor,
    cache: PagedKVCache,
    *,
    max_seq_len: int,
    config: MmaDecodeConfig,
    num_splits: int | None = None,
    multiprocessors: int = H200_MULTIPROCESSORS,
    resident_blocks: int = H200_RESIDENT_BLOCKS,
) -> LaunchPlan:
    kv_heads = cache.key_cache.shape[2]
    return plan_launch(
        config, q.shape[0], q.shape[1], kv_heads, max_seq_len, multiprocessors, num_splits, resident_blocks
    )


def model_paged_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    *,
    max_seq_len: int,
    config: MmaDecodeConfig,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,
    multiprocessors: int = H200_MULTIPROCESSORS,
    resident_blocks: int = H200_RESIDENT_BLOCKS,
) -> tuple[torch.Tensor, Partials]:
    """`paged_decode(..., config=config)` as the CUDA kernel computes it: fp32 output [seqs, heads, D], partials."""
    plan = model_launch(
        q, cache, max_seq_len=max_seq_len, config=config, num_splits=num_splits, multiprocessors=multiprocessors,
        resident_blocks=resident_blocks,
    )  # fmt: skip
    partials = model_partials(q, cache, plan, config, qk_log2_scale(q.shape[2], None, q_scale, k_scale))
    return model_combine(partials, v_scale), partials
