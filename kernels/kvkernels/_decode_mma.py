"""The FP8 paged-decode partial kernel in CUDA C++ (csrc/paged_decode_fp8.cu): built with NVRTC at first use."""

from __future__ import annotations

import ctypes
import math
import threading
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
# q, k_cache, v_cache, block_table, seq_lens, part_acc, part_max, part_sum, qk_scale, group, tokens_per_split, then
# the strides s_qs, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_as, s_ah, s_ap, s_ms, s_mh.
SIGNATURE = (_P,) * 8 + (_F32, _I32, _I32) + (_I64,) * 14


@dataclass(frozen=True)
class MmaDecodeConfig:
    """Launch shape of the CUDA decode kernel: tokens per pipeline step, copy stages in flight, KV heads per block
    (the block's warps read the same tokens of that many heads, so a page's bytes are fetched together; the effective
    number is the largest divisor of the model's KV heads up to this), warps per KV head (token slices), and blocks to
    aim for per multiprocessor at most, and the fewest pipeline steps (tiles per warp) a split is cut down to for the
    sake of more waves of blocks (splits follow from both, `choose_mma_splits`). Defaults: the fastest on an H200
    over 140 decode shapes beside FA3 (BENCHMARKS.md): 3 stages and splits of >= 128 steps gave the best geometric
    mean; with one sequence of 262,144 tokens the partial kernel took 139 us with 124 steps a split, 143 with 62 and
    150 with 31, and every extra split adds a partial to write and merge."""

    tile: int = 16
    stages: int = 3
    heads_per_block: int = 8
    warps_per_head: int = 1
    blocks_per_multiprocessor: int = 4
    min_split_steps: int = 128

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


def choose_mma_splits(
    units: int, steps: int, multiprocessors: int, resident_blocks: int, most_blocks: int, min_split_steps: int
) -> int:
    """Splits per (sequence, KV-head block) for the CUDA kernel, from shapes the host knows (no device sync).

    `units`: sequences x KV-head blocks; `steps`: pipeline steps of the longest sequence; `resident_blocks`: blocks
    of the kernel that fit on one multiprocessor at once, so a wave is `multiprocessors * resident_blocks` blocks;
    `most_blocks`: blocks to launch at most. Splits fill whole waves, as many waves as fit in `most_blocks` (several
    waves even out sequences of different lengths; the host knows only the longest) while every split keeps
    `min_split_steps` steps; when no split count keeps that many, one wave (a few short sequences still fill the
    GPU). Never more splits than steps, never fewer than one.
    """
    wave = max(1, multiprocessors * resident_blocks)
    for waves in range(max(1, most_blocks // wave), 0, -1):
        splits = waves * wave // units
        if splits >= 1 and steps >= splits * min_split_steps:
            return splits
    return max(1, min(steps, wave // units))


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is cut up: grid (splits, KV-head blocks, sequences) of `threads` each, the warps of a block
    being `heads_in_block` KV heads x `config.warps_per_head` token slices; every split covers
    `tokens_per_split` tokens of a sequence, cut into `config.warps_per_head` slices, one per warp; the partials have
    `num_parts` = splits x slices entries per (sequence, query head)."""

    grid: tuple[int, int, int]
    threads: int
    heads_in_block: int
    group: int
    tokens_per_split: int
    num_parts: int


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
    """The launch of `paged_decode_fp8_mma` for this call: without `num_splits`, `choose_mma_splits` with waves of
    `resident_blocks` blocks per multiprocessor and at most `config.blocks_per_multiprocessor` blocks per one."""
    heads_in_block = config.heads_in_block(kv_heads)
    tokens_per_step = config.tile * config.warps_per_head
    if num_splits is None:
        num_splits = choose_mma_splits(
            seqs * (kv_heads // heads_in_block),
            -(-max_seq_len // tokens_per_step),
            multiprocessors,
            resident_blocks,
            config.blocks_per_multiprocessor * multiprocessors,
            config.min_split_steps,
        )
    tokens_per_split = -(-max_seq_len // (num_splits * tokens_per_step)) * tokens_per_step
    return LaunchPlan(
        grid=(num_splits, kv_heads // heads_in_block, seqs),
        threads=32 * heads_in_block * config.warps_per_head,
        heads_in_block=heads_in_block,
        group=query_heads // kv_heads,
        tokens_per_split=tokens_per_split,
        num_parts=num_splits * config.warps_per_head,
    )


def source() -> str:
    return resources.files("kvkernels").joinpath("csrc", SOURCE_NAME).read_text()


def defines(config: MmaDecodeConfig, head_dim: int, page_size: int, kv_heads: int, group: int) -> dict[str, int]:
    return {
        "HEAD_DIM": head_dim,
        "PAGE_SIZE": page_size,
        "TILE": config.tile,
        "STAGES": config.stages,
        "HEADS_PER_BLOCK": config.heads_in_block(kv_heads),
        "SLICES": config.warps_per_head,
        "ROWS16": int(group > MAX_GROUP // 2),
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
    device: torch.device, config: MmaDecodeConfig, head_dim: int, page_size: int, kv_heads: int, group: int
) -> CudaKernel:
    """The compiled and loaded kernel for this shape (cached per device)."""
    config.validate()
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    consts = defines(config, head_dim, page_size, kv_heads, group)
    key = (index, tuple(sorted(consts.items())))
    with _kernels_lock:
        if key not in _kernels:
            cubin = compile_cubin(source(), SOURCE_NAME, major * 10 + minor, consts)
            _kernels[key] = load_kernel(
                cubin, FUNCTION_NAME, torch.device("cuda", index), SIGNATURE, config.shared_bytes(head_dim, kv_heads)
            )
        return _kernels[key]
