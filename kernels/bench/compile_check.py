"""Compile every kernel variant for Hopper (sm_90) without a GPU, and report resources.

Costs no device time: Triton's NVIDIA backend and ptxas run on the CPU. Prints, per variant, shared memory, registers
and spill bytes (from cuobjdump) and which matrix instructions the PTX uses (wgmma = Hopper's; mma = the older path).
Run: python kernels/bench/compile_check.py  (needs only triton; numbers are for the Triton version installed).
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvkernels._decode_kernels import paged_decode_partial_kernel
from kvkernels._prefill_kernels import prefill_kernel

ELEMENT = {"fp8": "fp8e4nv", "bf16": "bf16"}


def _signature(fn: triton.JITFunction, pointers: dict[str, str], ones: set[str], constants: dict[str, object]):
    names = list(inspect.signature(fn.fn).parameters)
    signature: dict[str, str] = {}
    consts: dict[str, object] = dict(constants)
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for index, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in ones:
            signature[name] = "constexpr"
            consts[name] = 1
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.startswith("s_") or name in ("tokens_per_split",):
            signature[name] = "i32"
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.endswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return ASTSource(fn, signature, consts, attrs)


def _resources(cubin: bytes) -> str:
    cuobjdump = shutil.which("cuobjdump") or str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", handle.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return "REG:{} STACK:{} SHARED:{} LOCAL:{}".format(*found.groups()) if found else text.strip()[-200:]


def _compile(label: str, src: ASTSource, warps: int, stages: int, target: GPUTarget) -> None:
    try:
        kernel = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    except Exception as error:  # report every failing variant, keep going
        print(f"{label}\tFAILED\t{type(error).__name__}: {str(error).splitlines()[0][:300]}")
        return
    ptx = kernel.asm["ptx"]
    mma = f"wgmma:{ptx.count('wgmma.mma_async')} mma:{len(re.findall(r'mma.sync', ptx))}"
    print(f"{label}\tok\tsmem:{kernel.metadata.shared}\t{_resources(kernel.asm['cubin'])}\t{mma}")


def prefill_variants(target: GPUTarget) -> None:
    configs = {64: (64, 128, 4, 3), 128: (128, 64, 4, 3), 256: (128, 128, 8, 3)}
    for dtype in ("fp8", "bf16"):
        element = ELEMENT[dtype]
        for head_dim, (bm, bn, warps, stages) in configs.items():
            for mode in ("single", "two", "split"):
                if dtype == "bf16" and mode != "single":
                    continue
                for causal in (False, True):
                    # FP8 V is token-contiguous (s_vn == 1); bf16 V is head_dim-contiguous (s_vd == 1).
                    ones = {"s_vn"} if dtype == "fp8" else {"s_vd"}
                    constants = {
                        "BLOCK_M": bm, "BLOCK_N": bn, "HEAD_DIM": head_dim, "CAUSAL": causal,
                        "TWO_LEVEL": mode != "single", "SPLIT_D": mode == "split", "MASK_TAIL": False,
                        "DIAGONAL_TILE": causal,
                        "P_LOG2_SCALE": math.log2(448.0) if dtype == "fp8" else 0.0,
                    }  # fmt: skip
                    pointers = {"Q": f"*{element}", "K": f"*{element}", "V": f"*{element}", "Out": "*bf16"}
                    src = _signature(prefill_kernel, pointers, ones, constants)
                    label = f"prefill {dtype} D={head_dim} {mode} causal={causal} cfg={bm},{bn},{warps},{stages}"
                    _compile(label, src, warps, stages, target)


def decode_variants(target: GPUTarget) -> None:
    for dtype in ("fp8", "bf16"):
        element = ELEMENT[dtype]
        fp8 = dtype == "fp8"
        for head_dim in (64, 128, 256):
            for two_level, upcast in ((False, False), (True, False), (True, True)):
                for block_n, warps, stages in ((64, 4, 3), (128, 4, 3), (256, 4, 2)):
                    constants = {
                        "GROUP_PAD": 16, "HEAD_DIM": head_dim, "PAGE_SIZE": 16, "BLOCK_N": block_n,
                        "TWO_LEVEL": two_level, "UPCAST_K": upcast and fp8, "UPCAST_V": upcast and fp8,
                        "P_LOG2_SCALE": math.log2(448.0) if dtype == "fp8" else 0.0,
                    }  # fmt: skip
                    pointers = {
                        "Q": f"*{element}", "KCache": f"*{element}", "VCache": f"*{element}", "BlockTable": "*i32",
                        "SeqLens": "*i32", "PartAcc": "*fp32", "PartMax": "*fp32", "PartSum": "*fp32",
                    }  # fmt: skip
                    src = _signature(paged_decode_partial_kernel, pointers, set(), constants)
                    label = f"decode {dtype} D={head_dim} two_level={two_level} upcast_v={upcast}"
                    label += f" cfg={block_n},{warps},{stages}"
                    _compile(label, src, warps, stages, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as an integer (default 90)")
    parser.add_argument("--only", choices=("prefill", "decode"), help="compile one family only")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    if args.only != "decode":
        prefill_variants(target)
    if args.only != "prefill":
        decode_variants(target)


if __name__ == "__main__":
    main()
