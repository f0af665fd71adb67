"""The CUDA decode kernel without a GPU: when it applies, its launch shapes, and that NVRTC builds every variant.

Its arithmetic is checked against the float64 reference on a GPU only (test_gpu.py): no CPU interpreter runs CUDA C++.
Here NVRTC (when found: a CUDA build of torch ships it, or KVKERNELS_NVRTC_LIBRARY names it) compiles the source for
sm_90 exactly as the first call on a GPU does, and cuobjdump (from Triton's package) shows it keeps to registers.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import triton
from kvkernels._cuda_runtime import CudaBuildUnavailable, compile_cubin, nvrtc_library
from kvkernels._decode_mma import (
    MmaDecodeConfig,
    defines,
    layout_unsupported_reason,
    plan_launch,
    sequence_splits,
    source,
)
from kvkernels.decode import DecodeConfig, build_paged_cache, default_decode_config
from kvkernels.quant import FP8_DTYPE

HOPPER = (9, 0)


def _nvrtc_or_skip() -> None:
    try:
        nvrtc_library()
    except CudaBuildUnavailable as error:
        pytest.skip(str(error))


def test_applies_to_fp8_caches_it_was_written_for() -> None:
    assert layout_unsupported_reason(HOPPER, FP8_DTYPE, 128, 16, 4, True) is None
    assert layout_unsupported_reason((8, 9), FP8_DTYPE, 256, 32, 16, True) is None


@pytest.mark.parametrize(
    ("capability", "dtype", "head_dim", "page", "group", "aligned", "expected"),
    [
        ((8, 0), FP8_DTYPE, 128, 16, 4, True, "sm_80"),
        (HOPPER, torch.bfloat16, 128, 16, 4, True, "FP8 e4m3 only"),
        (HOPPER, FP8_DTYPE, 64, 16, 4, True, "head_dim 64"),
        (HOPPER, FP8_DTYPE, 128, 8, 4, True, "page size 8"),
        (HOPPER, FP8_DTYPE, 128, 16, 32, True, "32 query heads per KV head"),
        (HOPPER, FP8_DTYPE, 128, 16, 4, False, "16-byte aligned"),
    ],
)
def test_names_why_it_does_not_apply(
    capability: tuple[int, int], dtype: torch.dtype, head_dim: int, page: int, group: int, aligned: bool, expected: str
) -> None:
    reason = layout_unsupported_reason(capability, dtype, head_dim, page, group, aligned)
    assert reason is not None and expected in reason


def test_cpu_calls_default_to_the_triton_kernel() -> None:
    cache = build_paged_cache([torch.zeros(2, 20, 128).to(FP8_DTYPE)], [torch.zeros(2, 20, 128).to(FP8_DTYPE)], 16)
    assert isinstance(default_decode_config(torch.zeros(1, 8, 128).to(FP8_DTYPE), cache), DecodeConfig)


def test_launch_shape_sizes_and_validation() -> None:
    # 8 KV heads, 3 stages of 32 tokens: 8 warps x 3 x 8 KiB = 192 KiB, one block per Hopper SM; the default (3
    # stages of 16 tokens) takes 96 KiB (its registers allow one block of 8 warps per SM anyway).
    assert MmaDecodeConfig().shared_bytes(128, kv_heads=8) == 8 * 3 * 4096
    assert MmaDecodeConfig(tile=32, stages=3, heads_per_block=8).shared_bytes(128, kv_heads=8) == 8 * 3 * 16 * 512
    # A model with 2 KV heads gets blocks of 2 heads; 12 KV heads, blocks of 4 (the largest divisor up to 8).
    assert MmaDecodeConfig(heads_per_block=8).heads_in_block(2) == 2
    assert MmaDecodeConfig(heads_per_block=8).heads_in_block(12) == 4
    assert MmaDecodeConfig(tile=16, stages=2, heads_per_block=1).shared_bytes(256, kv_heads=8) == 2 * 16 * 512
    for bad in (
        MmaDecodeConfig(tile=24),
        MmaDecodeConfig(stages=1),
        MmaDecodeConfig(warps_per_head=0),
        MmaDecodeConfig(min_split_steps=0),
    ):
        with pytest.raises(ValueError, match="invalid MmaDecodeConfig"):
            bad.validate()
    assert defines(MmaDecodeConfig(), 128, 16, 8, 4)["ROWS16"] == 0
    assert defines(MmaDecodeConfig(), 128, 16, 8, 9)["ROWS16"] == 1
    assert defines(MmaDecodeConfig(heads_per_block=8), 128, 16, 2, 4)["HEADS_PER_BLOCK"] == 2


DEVICE = MmaDecodeConfig(plan_on_device=True)
H200_SMS, H200_RESIDENT = 132, 1  # the default launch shape keeps one block of 8 warps per multiprocessor


@pytest.mark.parametrize(
    ("seqs", "query_heads", "kv_heads", "length", "splits", "blocks"),
    [
        (1, 32, 8, 262144, 132, 132),  # one long sequence: one wave of 124-step splits (was 528 splits of 32 steps)
        (1, 32, 8, 32768, 132, 132),  # too short for 128 steps a split: still one wave that fills the GPU
        (2, 64, 8, 131072, 66, 132),
        (8, 32, 8, 32768, 16, 132),  # 128 of the 132 blocks busy
        (16, 32, 8, 131072, 33, 528),  # many sequences: 4 waves as before
        (64, 64, 8, 16384, 8, 528),  # 4 waves: 512 blocks busy (was 9 splits: 576 blocks, a fifth wave of 48)
        (128, 32, 8, 4096, 2, 264),  # 2 waves: 4 would cut splits below 128 steps
        (8, 8, 4, 65536, 16, 132),
        (200, 32, 8, 4096, 2, 528),
        (600, 32, 8, 4096, 1, 600),
    ],
)
def test_plan_fills_whole_waves_of_an_h200(
    seqs: int, query_heads: int, kv_heads: int, length: int, splits: int, blocks: int
) -> None:
    """Equal lengths: the host plan's split count, and the same from the plan on the device in a grid of `blocks`."""
    plan = plan_launch(MmaDecodeConfig(), seqs, query_heads, kv_heads, length, H200_SMS, resident_blocks=H200_RESIDENT)
    assert plan.grid == (splits, 1, seqs) and plan.num_parts == splits * seqs
    assert plan.tokens_per_split * splits >= length
    device = plan_launch(DEVICE, seqs, query_heads, kv_heads, length, H200_SMS, resident_blocks=H200_RESIDENT)
    assert device.grid == (blocks, 1, 1)
    assert sequence_splits([length] * seqs, device) == sequence_splits([length] * seqs, plan) == [splits] * seqs
    assert device.max_parts >= splits and device.num_parts == blocks


@pytest.mark.parametrize(
    ("lengths", "splits"),
    [
        ((262144, 16384), [123, 8]),  # was 66 each: the long one's splits 2,144 tokens instead of 3,972
        ((65536,) * 2 + (1024,) * 30, [41] * 2 + [1] * 30),  # was 16 each: 1,600 tokens a split instead of 4,096
        ((262144, 4096, 4096, 4096), [123, 2, 2, 2]),  # was 99 each
        ((131072,) * 16 + (0,), [32] * 16 + [1]),  # a sequence of no token still takes its (empty) split
    ],
)
def test_long_sequences_among_short_ones_get_splits_by_length(lengths: tuple[int, ...], splits: list[int]) -> None:
    plan = plan_launch(DEVICE, len(lengths), 32, 8, max(lengths), H200_SMS, resident_blocks=H200_RESIDENT)
    assert sequence_splits(lengths, plan) == splits
    assert sum(splits) <= plan.grid[0]


@pytest.mark.parametrize("resident", [1, 2, 3])
@pytest.mark.parametrize("units", [1, 2, 3, 7, 16, 64, 131, 132, 133, 500, 2000])
@pytest.mark.parametrize("steps", [1, 5, 63, 64, 100, 1000, 16384])
def test_split_choice_bounds(resident: int, units: int, steps: int) -> None:
    sms, most = 132, 4 * 132
    wave = sms * resident
    config = MmaDecodeConfig()
    plan = plan_launch(config, units, 8, 8, steps * config.tile, sms, resident_blocks=resident)
    (splits,) = set(sequence_splits([steps * config.tile] * units, plan))
    assert 1 <= splits <= max(1, steps)
    blocks = splits * units
    assert plan.grid == (splits, 1, units)
    if splits > 1:
        waves = -(-blocks // wave)
        assert blocks <= max(most, wave)  # no more blocks than aimed for
        # splits keep enough steps, unless even one wave of splits cannot
        assert steps >= splits * config.min_split_steps or waves == 1
        if splits < steps:  # not cut to one step a split: whole waves, short of full by less than one split's blocks
            assert waves * wave - blocks < units
    if units < wave and steps >= wave // units:
        assert blocks > wave - units  # a few short sequences still fill the GPU once


@pytest.mark.parametrize(
    ("head_dim", "group", "config"),
    [
        (128, 4, MmaDecodeConfig()),
        (128, 12, MmaDecodeConfig()),
        (128, 4, MmaDecodeConfig(tile=64, stages=2, heads_per_block=1, warps_per_head=2)),
        (256, 4, MmaDecodeConfig(tile=16)),
        (256, 16, MmaDecodeConfig(tile=16, stages=2)),
        (128, 4, MmaDecodeConfig(heads_per_block=8, stages=4, tile=16)),
        (128, 4, DEVICE),
        (256, 8, MmaDecodeConfig(warps_per_head=2, heads_per_block=4, plan_on_device=True)),
    ],
)
def test_nvrtc_builds_it_for_hopper(head_dim: int, group: int, config: MmaDecodeConfig) -> None:
    _nvrtc_or_skip()
    cubin = compile_cubin(source(), "paged_decode_fp8.cu", 90, defines(config, head_dim, 16, 8, group))
    assert cubin[:4] == b"\x7fELF"
    cuobjdump = shutil.which("cuobjdump") or str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")
    # The default shape with up to 8 query heads per KV head (GQA 32/8, the benchmarked one) keeps to registers.
    if config in (MmaDecodeConfig(), DEVICE) and group <= 8 and Path(cuobjdump).exists():
        path = Path(__file__).parent / f".decode-{head_dim}-{group}.cubin"
        try:
            path.write_bytes(cubin)
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True)
        finally:
            path.unlink(missing_ok=True)
        assert re.search(r"STACK:0 .*LOCAL:0", usage.stdout), usage.stdout


def test_nvrtc_reports_compile_errors_with_the_log() -> None:
    _nvrtc_or_skip()
    from kvkernels._cuda_runtime import CudaBuildError

    with pytest.raises(CudaBuildError, match="did not compile"):
        compile_cubin('extern "C" __global__ void broken() { undefined_name; }', "broken.cu", 90, {})


@pytest.mark.parametrize(
    ("seqs", "length", "resident", "fused"),
    [
        (1, 32768, 1, True),  # one wave of 132 splits: merged in the kernel
        (2, 65536, 1, True),
        (8, 32768, 1, True),  # 128 blocks
        (4, 262144, 1, False),  # 3 waves (99 splits of 4 sequences): blocks would wait on ones not yet resident
        (16, 131072, 1, False),
        (2, 65536, 2, True),  # two resident blocks an SM: a wave of 264
    ],
)
def test_fused_merge_only_where_every_block_is_resident(seqs: int, length: int, resident: int, fused: bool) -> None:
    config = MmaDecodeConfig(fused_merge=True)
    plan = plan_launch(config, seqs, 32, 8, length, H200_SMS, resident_blocks=resident)
    assert plan.fused == fused
    assert not fused or plan.grid[0] * plan.grid[1] * plan.grid[2] <= H200_SMS * resident
    assert not plan_launch(MmaDecodeConfig(), seqs, 32, 8, length, H200_SMS).fused  # opt-in
    device = MmaDecodeConfig(fused_merge=True, plan_on_device=True)
    assert not plan_launch(device, seqs, 32, 8, length, H200_SMS, resident_blocks=resident).fused


@pytest.mark.parametrize("out_kind", [0, 1, 2])
@pytest.mark.parametrize(("head_dim", "group"), [(128, 4), (128, 12), (256, 8)])
def test_nvrtc_builds_the_fused_merge(head_dim: int, group: int, out_kind: int) -> None:
    _nvrtc_or_skip()
    consts = defines(MmaDecodeConfig(), head_dim, 16, 8, group, out_kind)
    assert (consts["FUSED_MERGE"], consts["OUT_KIND"]) == (1, out_kind)
    assert "FUSED_MERGE" not in defines(MmaDecodeConfig(), head_dim, 16, 8, group)
    assert compile_cubin(source(), "paged_decode_fp8.cu", 90, consts)[:4] == b"\x7fELF"
