"""Split-KV (flash-decoding) attention over a paged FP8 KV cache, in Triton."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import triton

from kvkernels import _decode_mma
from kvkernels._cuda_runtime import CudaBuildUnavailable, CudaKernel
from kvkernels._decode_kernels import paged_decode_partial_kernel, paged_decode_reduce_kernel
from kvkernels._decode_mma import LaunchPlan, MmaDecodeConfig, choose_num_splits, plan_launch
from kvkernels.modes import AccumulationMode, parse_mode
from kvkernels.prefill import LOG2_E, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from kvkernels.quant import FP8_DTYPE, FP8_MAX

__all__ = [
    "DecodeConfig",
    "MmaDecodeConfig",
    "PagedKVCache",
    "build_paged_cache",
    "choose_num_splits",
    "combine_partials",
    "default_decode_config",
    "paged_decode",
    "qk_log2_scale",
]

# mma instructions need at least 16 rows: the GQA group of query heads is padded to this.
MIN_GROUP_ROWS = 16
# Split-KV programs to launch per multiprocessor when the caller names no target (best measured on an H200).
PROGRAMS_PER_MULTIPROCESSOR = 16
# The reduce kernel reads a chunk of splits x columns at once: up to REDUCE_SPLITS splits (a plan of two waves of an
# H200 in one chunk, so one round trip to memory), with columns narrowed from REDUCE_COLUMNS to keep the chunk at
# REDUCE_ELEMENTS floats (32 registers a thread at 4 warps).
REDUCE_COLUMNS = 32
REDUCE_SPLITS = 256
REDUCE_ELEMENTS = 4096


@dataclass(frozen=True)
class DecodeConfig:
    """The Triton decode kernel (any dtype, head_dim and page size): tokens per tile, launch parameters, programs to
    aim for (None: 16 per multiprocessor), and whether FP8 keys and values are converted to bf16 for the matrix
    products (the cache stays FP8; only the arithmetic changes).

    The defaults were the fastest Triton settings on an H200 (kernels/BENCHMARKS.md); bf16 P·V is also the more
    accurate choice, since P then keeps 8 mantissa bits instead of e4m3's 3.
    """

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int | None = None
    upcast_keys: bool = False
    upcast_values: bool = True


@dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache in vLLM's flash-attention layout and the pages each sequence owns.

    key_cache, value_cache: [num_blocks, page_size, kv_heads, head_dim]; block_table: [sequences, max_pages] int32;
    seq_lens: [sequences] int32.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def build_paged_cache(
    keys: list[torch.Tensor], values: list[torch.Tensor], page_size: int, generator: torch.Generator | None = None
) -> PagedKVCache:
    """Scatter each sequence's keys and values ([kv_heads, L, D] each) into shuffled pages of one cache."""
    if len(keys) != len(values) or not keys:
        raise ValueError("need one values tensor per keys tensor, and at least one sequence")
    kv_heads, _, head_dim = keys[0].shape
    lengths = [k.shape[1] for k in keys]
    pages_per_seq = [-(-n // page_size) for n in lengths]
    total_pages = sum(pages_per_seq)
    device = keys[0].device
    order = torch.randperm(total_pages, generator=generator, device="cpu").to(device)
    key_cache = torch.zeros(total_pages, page_size, kv_heads, head_dim, dtype=keys[0].dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.zeros(len(keys), max(pages_per_seq), dtype=torch.int32, device=device)
    first = 0
    for seq, (k, v, pages) in enumerate(zip(keys, values, pages_per_seq, strict=True)):
        ids = order[first : first + pages]
        first += pages
        block_table[seq, :pages] = ids.to(torch.int32)
        padded = pages * page_size
        for cache, src in ((key_cache, k), (value_cache, v)):
            tokens = torch.zeros(padded, kv_heads, head_dim, dtype=src.dtype, device=device)
            tokens[: src.shape[1]] = src.transpose(0, 1)
            cache[ids] = tokens.view(pages, page_size, kv_heads, head_dim)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return PagedKVCache(key_cache, value_cache, block_table, seq_lens)


def paged_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    *,
    max_seq_len: int,
    mode: AccumulationMode | str = AccumulationMode.TWO_LEVEL,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    num_splits: int | None = None,
    config: DecodeConfig | MmaDecodeConfig | None = None,
) -> torch.Tensor:
    """One decode step: q [sequences, Hq, D] against each sequence's cached tokens; returns [sequences, Hq, D].

    `max_seq_len` bounds cache.seq_lens (passed in so the call needs no device-to-host sync). The query and the
    cache share one dtype: FP8 e4m3 with per-tensor scales, or bf16/fp16 for a baseline of the same design.
    `config` picks the kernel: MmaDecodeConfig, the CUDA C++ kernel (FP8, head_dim 128/256, pages of a multiple of 16
    tokens, up to 16 query heads per KV head; two-level), or DecodeConfig, the Triton kernel (everything else). With
    None, FP8 two-level calls take the CUDA kernel where it applies and NVRTC is found, else the Triton one.
    `num_splits`: programs per (sequence, KV head); by default enough to fill the GPU.
    Two-level and two-level-split are the same here (the group's partial is small). Decode uses mma.sync, not
    Hopper's truncating wgmma, so even single-level showed no cliff on an H200 (BENCHMARKS.md).
    """
    mode = parse_mode(mode)
    _validate(q, cache, max_seq_len)
    qk_scale = qk_log2_scale(q.shape[2], softmax_scale, q_scale, k_scale)
    cfg = config if config is not None else default_decode_config(q, cache, mode)
    if isinstance(cfg, MmaDecodeConfig):
        _check_mma(q, cache, mode)
        launch = mma_launch(q, cache, max_seq_len, cfg, num_splits)
        return _mma_decode(q, cache, launch, cfg, qk_scale, v_scale, out_dtype)
    part_acc, part_max, part_sum = _triton_partials(q, cache, max_seq_len, mode, qk_scale, num_splits, cfg)
    return combine_partials(part_acc, part_max, part_sum, v_scale, out_dtype)


def qk_log2_scale(head_dim: int, softmax_scale: float | None, q_scale: float, k_scale: float) -> float:
    """What the kernels multiply raw q·k products by: the softmax scale (1/sqrt(head_dim) by default) and the FP8
    scales of q and k, in log2 units (the kernels use exp2)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return scale * q_scale * k_scale * LOG2_E


def combine_partials(
    part_acc: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    v_scale: float,
    out_dtype: torch.dtype,
    part_index: torch.Tensor | None = None,
    max_parts: int | None = None,
) -> torch.Tensor:
    """Merges the split partials (unnormalised outputs, running max in log2 units, running sum) into [seqs, heads,
    D], scaled by `v_scale` (the reduce kernel). Without `part_index`: [seqs, heads, parts, D] and [seqs, heads,
    parts]. With it (the CUDA kernel's layout): [heads, rows, D] and [heads, rows], sequence s owning rows
    [part_index[s, 0], part_index[s, 0] + part_index[s, 1]), at most `max_parts` of them."""
    if part_index is None:
        seqs, heads, num_parts, head_dim = part_acc.shape
        strides = (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_max.stride(0), part_max.stride(1))
    else:
        (heads, num_parts, head_dim), seqs = part_acc.shape, part_index.shape[0]
        num_parts = max_parts if max_parts is not None else num_parts
        strides = (0, part_acc.stride(0), part_acc.stride(1), 0, part_max.stride(0))
    out = torch.empty(seqs, heads, head_dim, device=part_acc.device, dtype=out_dtype)
    splits_block, block_d = reduce_shape(num_parts, head_dim)
    paged_decode_reduce_kernel[(seqs, heads, head_dim // block_d)](
        part_acc, part_max, part_sum, part_index if part_index is not None else part_max, out, v_scale, num_parts,
        *strides, out.stride(0), out.stride(1),
        BLOCK_D=block_d, SPLITS_BLOCK=splits_block, INDEXED=part_index is not None,
    )  # fmt: skip
    return out


def reduce_shape(
    num_parts: int,
    head_dim: int,
    most_splits: int = REDUCE_SPLITS,
    most_columns: int = REDUCE_COLUMNS,
    elements: int = REDUCE_ELEMENTS,
) -> tuple[int, int]:
    """(splits, columns) the reduce kernel reads at once for `num_parts` splits a sequence: every split if at most
    `most_splits` (one round trip), columns narrowed so the chunk stays within `elements` floats, never under 8
    (a 32-byte sector of a partial row)."""
    splits = min(triton.next_power_of_2(max(1, num_parts)), most_splits)
    columns = max(8, min(head_dim, most_columns, elements // splits))
    return splits, columns


_mma_fallback_warned = False


def default_decode_config(
    q: torch.Tensor, cache: PagedKVCache, mode: AccumulationMode | str = AccumulationMode.TWO_LEVEL
) -> DecodeConfig | MmaDecodeConfig:
    """The kernel `paged_decode` runs when the caller names none: the CUDA one where it applies, else Triton's."""
    global _mma_fallback_warned
    if not parse_mode(mode).two_level:
        return DecodeConfig()
    if _decode_mma.unsupported_reason(q, cache.key_cache, cache.value_cache) is not None:
        return DecodeConfig()
    config = MmaDecodeConfig()
    kv_heads = cache.key_cache.shape[2]
    try:
        _decode_mma.kernel_for(q.device, config, q.shape[2], cache.key_cache.shape[1], kv_heads, q.shape[1] // kv_heads)
    except CudaBuildUnavailable as error:
        if not _mma_fallback_warned:
            warnings.warn(f"kvkernels: FP8 decode runs the slower Triton kernel: {error}", stacklevel=3)
            _mma_fallback_warned = True
        return DecodeConfig()
    return config


def _part_buffers(q: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, heads, head_dim = q.shape
    part_acc = torch.empty(seqs, heads, num_parts, head_dim, device=q.device, dtype=torch.float32)
    part_max = torch.empty(seqs, heads, num_parts, device=q.device, dtype=torch.float32)
    return part_acc, part_max, torch.empty_like(part_max)


@dataclass(frozen=True)
class MmaPartials:
    """What the CUDA kernel writes: [heads, rows, D] unnormalised outputs, [heads, rows] running max (log2 units)
    and running sum; `max_parts` bounds a sequence's rows. A host plan: sequence s's rows are [s * max_parts,
    (s + 1) * max_parts), `index` None. A device plan: rows [index[s, 0], index[s, 0] + index[s, 1]) (index [seqs, 2]
    int32, written by the kernel; rows of idle blocks are left unwritten)."""

    acc: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor
    index: torch.Tensor | None
    max_parts: int

    def merge(self, v_scale: float, out_dtype: torch.dtype) -> torch.Tensor:
        """The reduce kernel over these partials: [seqs, heads, D]."""
        if self.index is not None:
            return combine_partials(self.acc, self.max, self.sum, v_scale, out_dtype, self.index, self.max_parts)
        heads, rows = self.acc.shape[:2]
        seqs = rows // self.max_parts
        per_seq = (
            t.view(heads, seqs, self.max_parts, *t.shape[2:]).transpose(0, 1) for t in (self.acc, self.max, self.sum)
        )
        return combine_partials(*per_seq, v_scale, out_dtype)


def _mma_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    launch: tuple[LaunchPlan, CudaKernel],
    cfg: MmaDecodeConfig,
    qk_scale: float,
    v_scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The CUDA kernel's output for this call, launched as `launch` (mma_launch) says: merged in the same kernel
    where the plan is fused (one launch), else by the reduce kernel after it."""
    plan, kernel = launch
    stream = torch.cuda.current_stream(q.device).cuda_stream
    barrier = _decode_mma.barrier_for(q.device, stream) if plan.fused else None
    if barrier is None or out_dtype not in _decode_mma.OUT_KINDS:
        return _launch_partials(q, cache, qk_scale, plan, kernel).merge(v_scale, out_dtype)
    seqs, heads, head_dim = q.shape
    page_size, kv_heads = cache.key_cache.shape[1], cache.key_cache.shape[2]
    fused = _decode_mma.kernel_for(q.device, cfg, head_dim, page_size, kv_heads, heads // kv_heads, out_dtype)
    if fused.resident_blocks(plan.threads) * _multiprocessors(q.device) < math.prod(plan.grid):
        return _launch_partials(q, cache, qk_scale, plan, kernel).merge(v_scale, out_dtype)  # not all resident
    out = torch.empty(seqs, heads, head_dim, device=q.device, dtype=out_dtype)
    _launch_partials(q, cache, qk_scale, plan, fused, (barrier, out, v_scale, out.stride(0), out.stride(1)))
    return out


def _check_mma(q: torch.Tensor, cache: PagedKVCache, mode: AccumulationMode) -> None:
    if not mode.two_level:
        raise ValueError(
            "the CUDA decode kernel (MmaDecodeConfig) is two-level only; use DecodeConfig for single-level"
        )
    reason = _decode_mma.unsupported_reason(q, cache.key_cache, cache.value_cache)
    if reason is not None:
        raise ValueError(f"MmaDecodeConfig cannot run this call: {reason}; use DecodeConfig (the Triton kernel)")


def _mma_partials(
    q: torch.Tensor,
    cache: PagedKVCache,
    max_seq_len: int,
    mode: AccumulationMode,
    qk_scale: float,
    num_splits: int | None,
    cfg: MmaDecodeConfig,
    plan: LaunchPlan | None = None,
) -> MmaPartials:
    """The CUDA partial kernel's outputs for this call, never merged in the kernel (the reduce kernel merges them);
    `plan` replaces the one planned for this GPU (tests run another GPU's plan with it)."""
    _check_mma(q, cache, mode)
    planned, kernel = mma_launch(q, cache, max_seq_len, cfg, num_splits)
    return _launch_partials(q, cache, qk_scale, plan if plan is not None else planned, kernel)


def _launch_partials(
    q: torch.Tensor,
    cache: PagedKVCache,
    qk_scale: float,
    plan: LaunchPlan,
    kernel: CudaKernel,
    fused: tuple[torch.Tensor, torch.Tensor, float, int, int] | None = None,
) -> MmaPartials:
    """Launches `kernel` as `plan` says; `fused` (the barrier's counters, the output, v_scale, the output's
    strides) for the build that merges the splits itself."""
    kc, vc = cache.key_cache, cache.value_cache
    seqs, heads, head_dim = q.shape
    part_acc = torch.empty(heads, plan.num_parts, head_dim, device=q.device, dtype=torch.float32)
    part_max = torch.empty(heads, plan.num_parts, device=q.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    part_index = torch.empty(seqs, 2, device=q.device, dtype=torch.int32) if plan.on_device else part_max
    # A host plan's sequence s owns rows [s * max_parts, ...): strides per sequence; a device plan's rows are the
    # blocks' own (strides 0).
    seq_stride = 0 if plan.on_device else plan.max_parts
    kernel.launch(
        plan.grid,
        plan.threads,
        torch.cuda.current_stream(q.device).cuda_stream,
        [
            q, kc, vc, cache.block_table, cache.seq_lens, part_acc, part_max, part_sum, part_index,
            qk_scale, plan.group, plan.tokens_per_split,
            seqs, plan.wave, plan.most_waves, plan.min_split_steps, plan.fixed_splits,
            q.stride(0), q.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2),
            cache.block_table.stride(0),
            seq_stride * part_acc.stride(1), part_acc.stride(0), part_acc.stride(1),
            seq_stride * part_max.stride(1), part_max.stride(0),
            *(fused if fused is not None else (part_max, part_max, 1.0, 0, 0)),
        ],
    )  # fmt: skip
    return MmaPartials(part_acc, part_max, part_sum, part_index if plan.on_device else None, plan.max_parts)


def mma_launch(
    q: torch.Tensor, cache: PagedKVCache, max_seq_len: int, cfg: MmaDecodeConfig, num_splits: int | None = None
) -> tuple[LaunchPlan, CudaKernel]:
    """The CUDA kernel for this call's shapes and how it is launched: splits planned from the shapes, the GPU's
    multiprocessors and how many of the kernel's blocks fit on one (all known on the host: no device sync)."""
    seqs, heads, head_dim = q.shape
    page_size, kv_heads = cache.key_cache.shape[1], cache.key_cache.shape[2]
    kernel = _decode_mma.kernel_for(q.device, cfg, head_dim, page_size, kv_heads, heads // kv_heads)
    resident = kernel.resident_blocks(32 * cfg.heads_in_block(kv_heads) * cfg.warps_per_head)
    plan = plan_launch(cfg, seqs, heads, kv_heads, max_seq_len, _multiprocessors(q.device), num_splits, resident)
    return plan, kernel


def _triton_partials(
    q: torch.Tensor,
    cache: PagedKVCache,
    max_seq_len: int,
    mode: AccumulationMode,
    qk_scale: float,
    num_splits: int | None,
    cfg: DecodeConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, heads, head_dim = q.shape
    page_size, kv_heads = cache.key_cache.shape[1], cache.key_cache.shape[2]
    group = heads // kv_heads
    if num_splits is None:
        target = cfg.target_programs or PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors(q.device)
        num_splits = choose_num_splits(seqs, kv_heads, max_seq_len, cfg.block_n, target)
    tiles_per_split = -(-max_seq_len // (num_splits * cfg.block_n))
    part_acc, part_max, part_sum = _part_buffers(q, num_splits)
    kc, vc = cache.key_cache, cache.value_cache
    paged_decode_partial_kernel[(seqs, kv_heads, num_splits)](
        q, kc, vc, cache.block_table, cache.seq_lens, part_acc, part_max, part_sum,
        qk_scale, group, tiles_per_split * cfg.block_n,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        cache.block_table.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_max.stride(0), part_max.stride(1),
        GROUP_PAD=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n, TWO_LEVEL=mode.two_level, UPCAST_K=cfg.upcast_keys and q.dtype == FP8_DTYPE,
        UPCAST_V=cfg.upcast_values and q.dtype == FP8_DTYPE,
        P_LOG2_SCALE=math.log2(FP8_MAX) if q.dtype == FP8_DTYPE else 0.0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return part_acc, part_max, part_sum


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 1


def _validate(q: torch.Tensor, cache: PagedKVCache, max_seq_len: int) -> None:
    kc, vc = cache.key_cache, cache.value_cache
    if q.dim() != 3 or kc.dim() != 4 or kc.shape != vc.shape:
        raise ValueError(f"q must be [seqs, heads, D], both caches [blocks, page, kv_heads, D]: {q.shape}, {kc.shape}")
    if not (q.dtype == kc.dtype == vc.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q and the caches must share one dtype among {SUPPORTED_DTYPES}: {q.dtype}, {kc.dtype}")
    if q.shape[2] != kc.shape[3] or q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must match ({q.shape[2]} vs {kc.shape[3]}) and be one of {SUPPORTED_HEAD_DIMS}")
    if q.shape[1] % kc.shape[2]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({kc.shape[2]})")
    if cache.block_table.shape[0] != q.shape[0] or cache.seq_lens.shape != (q.shape[0],):
        raise ValueError("block_table and seq_lens need one row per sequence of q")
    if max_seq_len < 1 or max_seq_len > cache.block_table.shape[1] * kc.shape[1]:
        raise ValueError(f"max_seq_len {max_seq_len} must be >= 1 and fit the block table's pages")
    if q.stride(-1) != 1 or kc.stride(-1) != 1 or vc.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    if cache.block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous along its pages (rows may have any stride)")
