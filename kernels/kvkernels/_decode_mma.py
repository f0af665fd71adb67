"""The FP8 paged-decode partial kernel in CUDA C++ (csrc/paged_decode_fp8.cu): built with NVRTC at first use."""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import torch

from kvkernels._cuda_runtime import CudaKernel, compile_cubin, load_kernel

SOURCE_NAME = "paged_decode_fp8.cu"
FUNCTION_NAME = "paged_decode_fp8_mma"
MMA_HEAD_DIMS = (128, 256)
MAX_GROUP = 16  # query heads per KV head: the 16 rows of one m16n8k16 product
PAGE_MULTIPLE = 16  # a 16-token chunk must lie inside one page

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
# q, k_cache, v_cache, block_table, seq_lens, part_acc, part_max, part_sum, part_index, qk_scale, group, then the plan
# (tokens_per_split for a host plan; seqs, wave, most_waves, min_split_steps, fixed_splits for a device plan), then the
# strides s_qs, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_as, s_ah, s_ap, s_ms, s_mh, then for a fused merge
# the barrier's two counters, the output, v_scale and the output's strides s_os, s_oh (unused by other builds).
SIGNATURE = (_P,) * 9 + (_F32,) + (_I32,) * 7 + (_I64,) * 14 + (_P, _P, _F32, _I64, _I64)
# The output types a fused merge writes (OUT_KIND).
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class MmaDecodeConfig:
    """Launch shape of the CUDA decode kernel: tokens per pipeline step, copy stages in flight, KV heads per block
    (the block's warps read the same tokens of that many heads, so a page's bytes are fetched together; the effective
    number is the largest divisor of the model's KV heads up to this), warps per KV head (token slices), and blocks to
    aim for per multiprocessor at most, and the fewest pipeline steps (tiles per warp) a split is cut down to for the
    sake of more waves of blocks (splits follow from both, `choose_budget`). Defaults: the fastest on an H200
    over 140 decode shapes beside FA3 (BENCHMARKS.md): 3 stages and splits of >= 128 steps gave the best geometric
    mean; with one sequence of 262,144 tokens the partial kernel took 139 us with 124 steps a split, 143 with 62 and
    150 with 31, and every extra split adds a partial to write and merge.

    `plan_on_device`: each sequence split by its own length, planned by the kernel from `seq_lens` (no host sync):
    one or two long sequences among short ones then fill the GPU, but that build streams ~17% slower on an H200
    (BENCHMARKS.md); by default every sequence is split as the longest (`max_seq_len`) is, planned on the host.

    `fused_merge`: a host plan of at most one wave (every block resident at once) merges the splits in the same
    kernel, behind a grid-wide barrier, instead of launching the reduce kernel after it (`LaunchPlan.fused`). Off by
    default: on an H200 it took 1.0-5.1 us more than the reduce kernel at 1, 2 and 4 sequences, and from 2.5 us less
    to 0.8 us more at 8 (BENCHMARKS.md, issue 27 fourth pass); no other launch may use its stream's counters while it
    runs (`barrier_for`), and each block waits for all others, so it needs the GPU's multiprocessors to itself."""

    tile: int = 16
    stages: int = 3
    heads_per_block: int = 8
    warps_per_head: int = 1
    blocks_per_multiprocessor: int = 4
    min_split_steps: int = 128
    plan_on_device: bool = False
    fused_merge: bool = False

    def heads_in_block(self, kv_heads: int) -> int:
        return math.gcd(kv_heads, self.heads_per_block)

    def shared_bytes(self, head_dim: int, kv_heads: int) -> int:
        warps = self.heads_in_block(kv_heads) * self.warps_per_head
        return warps * self.stages * 2 * self.tile * head_dim  # a stage: one tile of keys and values

    def validate(self) -> None:
        if (
            self.tile % 16
            or self.tile < 16
            or self.stages < 2
            or self.heads_per_block < 1
            or self.warps_per_head < 1
            or self.blocks_per_multiprocessor < 1
            or self.min_split_steps < 1
        ):
            raise ValueError(
                f"invalid MmaDecodeConfig {self}: tile a multiple of 16, stages >= 2; heads, warps, blocks and split"
                " steps >= 1"
            )


def choose_num_splits(seqs: int, kv_heads: int, max_len: int, block_n: int, target_programs: int) -> int:
    """Splits per sequence so that the grid has about `target_programs` programs, each with at least one tile."""
    wanted = max(1, -(-target_programs // (seqs * kv_heads)))
    return max(1, min(wanted, -(-max_len // block_n)))


def split_count(budget: int, seqs: int, total_steps: int, steps: int) -> int:
    """Splits of one sequence of `steps` pipeline steps when a row of the grid has `budget` blocks for `seqs`
    sequences of `total_steps` steps in all: one each, and the other `budget - seqs` shared in proportion to length
    (floor), never more than its steps. For equal lengths this is `budget // seqs`; the counts never sum past
    `budget` (or `seqs`, when that is more)."""
    if budget <= seqs:
        return 1
    return max(1, min(steps, 1 + (budget - seqs) * steps // max(1, total_steps)))


def choose_budget(steps: Sequence[int], wave: int, kv_blocks: int, most_waves: int, min_split_steps: int) -> int:
    """Blocks of a grid row (one of `kv_blocks` KV-head blocks) to share among the sequences: as many whole waves
    (`wave` blocks in all rows) as `most_waves` allows while the longest sequence's splits keep `min_split_steps`
    steps; when none does, one wave (a few short sequences still fill the GPU)."""
    longest, total = max(steps), sum(steps)
    for waves in range(most_waves, 0, -1):
        budget = waves * wave // kv_blocks
        if longest >= split_count(budget, len(steps), total, longest) * min_split_steps:
            return budget
    return wave // kv_blocks


def sequence_splits(lengths: Sequence[int], plan: LaunchPlan) -> list[int]:
    """Splits of each sequence. A host plan: the grid's, for every sequence. A device plan, as the kernel makes it
    from `seq_lens` (csrc: `plan_work`): the caller's fixed count, or `split_count` under `choose_budget`; block x of
    a grid row runs split x - first of the sequence whose splits [first, first + count) hold x (sequences in order);
    blocks past the last are idle."""
    if not plan.on_device:
        return [plan.grid[0]] * len(lengths)
    if plan.fixed_splits:
        return [plan.fixed_splits] * len(lengths)
    steps = [-(-n // plan.tokens_per_step) for n in lengths]
    budget = choose_budget(steps, plan.wave, plan.grid[1], plan.most_waves, plan.min_split_steps)
    return [split_count(budget, len(steps), sum(steps), n) for n in steps]


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is cut up: `threads` a block, the warps of a block being `heads_in_block` KV heads x
    `config.warps_per_head` token slices; a split is cut into slices, one per warp. Partials are rows of [heads,
    `num_parts`, ...] buffers, at most `max_parts` of them a sequence's.

    A host plan (`on_device` False): grid (splits, KV-head blocks, sequences), every sequence cut into splits of
    `tokens_per_split` tokens; sequence s's rows are [s * max_parts, (s + 1) * max_parts).
    A device plan: grid (blocks, KV-head blocks, 1); which sequence and split a block runs is planned by the kernel
    from `seq_lens` (`sequence_splits`) with what the host gives: `wave` blocks fill the GPU once (multiprocessors x
    resident blocks), at most `most_waves` waves, splits of at least `min_split_steps` steps of `tokens_per_step`
    tokens, or `fixed_splits` per sequence (0: planned); a block's rows are `block x slices + slice`, and the kernel
    writes each sequence's (first row, rows) for the reduce.
    `fused`: the kernel merges the splits itself (a host plan whose grid fits one wave: the barrier it waits at needs
    every block resident at once)."""

    grid: tuple[int, int, int]
    threads: int
    heads_in_block: int
    group: int
    on_device: bool
    tokens_per_split: int
    wave: int
    most_waves: int
    min_split_steps: int
    fixed_splits: int
    tokens_per_step: int
    num_parts: int
    max_parts: int
    fused: bool = False


def plan_launch(
    config: MmaDecodeConfig,
    seqs: int,
    query_heads: int,
    kv_heads: int,
    max_seq_len: int,
    multiprocessors: int,
    num_splits: int | None = None,
    resident_blocks: int = 1,
) -> LaunchPlan:
    """The launch of `paged_decode_fp8_mma` for this call, from host-known shapes only (no device sync): waves of
    `resident_blocks` blocks per multiprocessor, at most `config.blocks_per_multiprocessor` blocks per one; or
    `num_splits` per sequence. A host plan splits every sequence as one of `max_seq_len` tokens is split among
    sequences of that length. A device plan's grid has as many blocks per row as the kernel's plan can use for any
    lengths up to `max_seq_len`: its budget is never more than the one planned for all sequences at that length."""
    heads_in_block = config.heads_in_block(kv_heads)
    kv_blocks = kv_heads // heads_in_block
    tokens_per_step = config.tile * config.warps_per_head
    most_steps = -(-max_seq_len // tokens_per_step)
    wave = max(1, multiprocessors * resident_blocks)
    most_waves = max(1, config.blocks_per_multiprocessor * multiprocessors // wave)
    budget = choose_budget([most_steps] * seqs, wave, kv_blocks, most_waves, config.min_split_steps)
    splits = num_splits if num_splits is not None else split_count(budget, seqs, seqs * most_steps, most_steps)
    if not config.plan_on_device:
        grid, per_sequence, rows = (splits, kv_blocks, seqs), splits, splits * seqs
    elif num_splits is not None:
        grid, per_sequence, rows = (num_splits * seqs, kv_blocks, 1), num_splits, num_splits * seqs
    else:
        blocks = max(budget, seqs)
        grid, per_sequence, rows = (blocks, kv_blocks, 1), (min(most_steps, budget) if budget > seqs else 1), blocks
    fused = config.fused_merge and not config.plan_on_device and math.prod(grid) <= wave
    return LaunchPlan(
        grid=grid,
        threads=32 * heads_in_block * config.warps_per_head,
        heads_in_block=heads_in_block,
        group=query_heads // kv_heads,
        on_device=config.plan_on_device,
        tokens_per_split=0
        if config.plan_on_device
        else -(-max_seq_len // (splits * tokens_per_step)) * tokens_per_step,
        wave=wave,
        most_waves=most_waves,
        min_split_steps=config.min_split_steps,
        fixed_splits=num_splits or 0,
        tokens_per_step=tokens_per_step,
        num_parts=rows * config.warps_per_head,
        max_parts=per_sequence * config.warps_per_head,
        fused=fused,
    )


def source() -> str:
    return resources.files("kvkernels").joinpath("csrc", SOURCE_NAME).read_text()


def defines(
    config: MmaDecodeConfig, head_dim: int, page_size: int, kv_heads: int, group: int, out_kind: int | None = None
) -> dict[str, int]:
    """The build's -D values; `out_kind` (OUT_KINDS) builds the fused merge writing that output type."""
    fused = {} if out_kind is None else {"FUSED_MERGE": 1, "OUT_KIND": out_kind}
    return fused | {
        "HEAD_DIM": head_dim,
        "PAGE_SIZE": page_size,
        "TILE": config.tile,
        "STAGES": config.stages,
        "HEADS_PER_BLOCK": config.heads_in_block(kv_heads),
        "SLICES": config.warps_per_head,
        "ROWS16": int(group > MAX_GROUP // 2),
        "DEVICE_PLAN": int(config.plan_on_device),
    }


def unsupported_reason(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
    """Why the CUDA kernel cannot serve this call (None: it can). Shapes are validated by the caller."""
    if q.device.type != "cuda":
        return "not a CUDA device"
    aligned = all(
        t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in t.stride()[:-1]) for t in (q, key_cache, value_cache)
    )
    return layout_unsupported_reason(
        torch.cuda.get_device_capability(q.device),
        q.dtype,
        q.shape[2],
        key_cache.shape[1],
        q.shape[1] // key_cache.shape[2],
        aligned,
    )


def layout_unsupported_reason(
    capability: tuple[int, int], dtype: torch.dtype, head_dim: int, page_size: int, group: int, aligned: bool
) -> str | None:
    """The checks of `unsupported_reason` on plain facts: GPU capability, dtype, head_dim, page size, query heads per
    KV head, and whether q and the caches are 16-byte aligned in every dimension but head_dim."""
    from kvkernels.quant import FP8_DTYPE

    if capability < (8, 9):
        return f"sm_{capability[0]}{capability[1]} has no FP8 conversion instructions (needs sm_89+)"
    if dtype != FP8_DTYPE:
        return f"{dtype} cache (the CUDA kernel reads FP8 e4m3 only)"
    if head_dim not in MMA_HEAD_DIMS:
        return f"head_dim {head_dim} (the CUDA kernel has {MMA_HEAD_DIMS})"
    if page_size % PAGE_MULTIPLE:
        return f"page size {page_size} is not a multiple of {PAGE_MULTIPLE}"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (at most {MAX_GROUP})"
    if not aligned:
        return "q or a cache is not 16-byte aligned in every dimension but head_dim"
    return None


_kernels: dict[tuple[int, tuple[tuple[str, int], ...]], CudaKernel] = {}
_kernels_lock = threading.Lock()


def kernel_for(
    device: torch.device,
    config: MmaDecodeConfig,
    head_dim: int,
    page_size: int,
    kv_heads: int,
    group: int,
    out_dtype: torch.dtype | None = None,
) -> CudaKernel:
    """The compiled and loaded kernel for this shape (cached per device); with `out_dtype`, the build that merges
    the splits itself and writes that type (a fused plan)."""
    config.validate()
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    out_kind = None if out_dtype is None else OUT_KINDS[out_dtype]
    consts = defines(config, head_dim, page_size, kv_heads, group, out_kind)
    key = (index, tuple(sorted(consts.items())))
    with _kernels_lock:
        if key not in _kernels:
            cubin = compile_cubin(source(), SOURCE_NAME, major * 10 + minor, consts)
            _kernels[key] = load_kernel(
                cubin, FUNCTION_NAME, torch.device("cuda", index), SIGNATURE, config.shared_bytes(head_dim, kv_heads)
            )
        return _kernels[key]


# The fused merge's barrier counters: two per stream a device's launches run on (launches on one stream never
# overlap; each leaves its counters at 0). Created outside any CUDA-graph capture, zeroed once.
BARRIER_SLOTS = 64
_barriers: dict[int, torch.Tensor] = {}
_barrier_slots: dict[tuple[int, int], int] = {}


def barrier_for(device: torch.device, stream: int) -> torch.Tensor | None:
    """The two counters of the fused merge's barrier for launches on `stream` (a CUDA stream handle) of `device`, or
    None where there are none to give (every slot taken, or the first call is being captured into a CUDA graph, when
    no memory may be zeroed outside it): the caller then merges with the reduce kernel."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _kernels_lock:
        if index not in _barriers:
            if torch.cuda.is_current_stream_capturing():
                return None
            _barriers[index] = torch.zeros(BARRIER_SLOTS, 2, dtype=torch.int32, device=torch.device("cuda", index))
            torch.cuda.synchronize(index)  # zero before any stream's first launch reads them (once per device)
        slot = _barrier_slots.get((index, stream))
        if slot is None:
            taken = sum(1 for key in _barrier_slots if key[0] == index)
            if taken >= BARRIER_SLOTS:
                return None
            slot = _barrier_slots[(index, stream)] = taken
        return _barriers[index][slot]
