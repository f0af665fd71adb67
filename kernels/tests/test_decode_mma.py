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
from kvkernels._decode_mma import MmaDecodeConfig, defines, layout_unsupported_reason, source
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
    # 8 KV heads, 3 stages of 32 tokens: 8 warps x 3 x 8 KiB = 192 KiB, one block per Hopper SM; the default (2
    # stages of 16 tokens) takes 64 KiB, three blocks.
    assert MmaDecodeConfig().shared_bytes(128, kv_heads=8) == 8 * 2 * 4096
    assert MmaDecodeConfig(tile=32, stages=3, heads_per_block=8).shared_bytes(128, kv_heads=8) == 8 * 3 * 16 * 512
    # A model with 2 KV heads gets blocks of 2 heads; 12 KV heads, blocks of 4 (the largest divisor up to 8).
    assert MmaDecodeConfig(heads_per_block=8).heads_in_block(2) == 2
    assert MmaDecodeConfig(heads_per_block=8).heads_in_block(12) == 4
    assert MmaDecodeConfig(tile=16, stages=2, heads_per_block=1).shared_bytes(256, kv_heads=8) == 2 * 16 * 512
    for bad in (MmaDecodeConfig(tile=24), MmaDecodeConfig(stages=1), MmaDecodeConfig(warps_per_head=0)):
        with pytest.raises(ValueError, match="invalid MmaDecodeConfig"):
            bad.validate()
    assert defines(MmaDecodeConfig(), 128, 16, 8, 4)["ROWS16"] == 0
    assert defines(MmaDecodeConfig(), 128, 16, 8, 9)["ROWS16"] == 1
    assert defines(MmaDecodeConfig(heads_per_block=8), 128, 16, 2, 4)["HEADS_PER_BLOCK"] == 2


@pytest.mark.parametrize(
    ("head_dim", "group", "config"),
    [
        (128, 4, MmaDecodeConfig()),
        (128, 12, MmaDecodeConfig()),
        (128, 4, MmaDecodeConfig(tile=64, stages=2, heads_per_block=1, warps_per_head=2)),
        (256, 4, MmaDecodeConfig(tile=16)),
        (256, 16, MmaDecodeConfig(tile=16, stages=2)),
        (128, 4, MmaDecodeConfig(heads_per_block=8, stages=4, tile=16)),
    ],
)
def test_nvrtc_builds_it_for_hopper(head_dim: int, group: int, config: MmaDecodeConfig) -> None:
    _nvrtc_or_skip()
    cubin = compile_cubin(source(), "paged_decode_fp8.cu", 90, defines(config, head_dim, 16, 8, group))
    assert cubin[:4] == b"\x7fELF"
    cuobjdump = shutil.which("cuobjdump") or str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")
    # The default shape with up to 8 query heads per KV head (GQA 32/8, the benchmarked one) keeps to registers.
    if config == MmaDecodeConfig() and group <= 8 and Path(cuobjdump).exists():
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
