"""Where Triton waits for each Hopper `wgmma` of the prefill loops (prefill_ceiling.py), compiled for sm_90 on the CPU.

    PYTHONPATH=kernels python kernels/bench/prefill_wgmma_waits.py

FA3 reaches its FP8 figure by keeping a warpgroup's Q·K^T of the next key tile in flight while the softmax of the
current one runs (and ping-pong between two warpgroups). In Triton that needs the `wgmma` of the next tile to stay
outstanding across the softmax. This compiles the stripped loops of prefill_ceiling.py ("products": both matrix
products and nothing else; "softmax": the two-level loop) and the same softmax loop written with
the next tile's Q·K^T issued before the softmax ("pipelined", `pipelined_kernel`) and prints, in program order, each
`ttng.warp_group_dot` (async or not), each `warp_group_dot_wait` with its `pendings` (how many wgmma groups may stay
in flight past it), and the softmax's exp2s, from the loop body of the TTGIR; and the counts of `wgmma.mma_async`
and `wgmma.wait_group N` in the PTX. No GPU needed (Triton's NVIDIA backend runs on the CPU).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prefill_ceiling as ceiling

FP8 = "*fp8e4nv"
BLOCK_M, BLOCK_N, HEAD_DIM, WARPS, STAGES = 64, 128, 128, 4, 3


def compiled(name: str) -> Any:
    common = {"Q": FP8, "K": FP8, "V": FP8, "Out": "*bf16", "qk_scale": "fp32", "seq_q": "i32", "seq_k": "i32"}
    consts: dict[str, object] = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "HEAD_DIM": HEAD_DIM}
    consts["P_SCALE"] = ceiling.P_LOG2_SCALE
    if name == "pipelined":
        fn, signature = ceiling.pipelined_kernel, dict(common)
    else:
        fn, signature = ceiling.ceiling_kernel, {"q_desc": "i32", "k_desc": "i32", "v_desc": "i32", **common}
        consts |= {"SOFTMAX": name == "softmax", "DESC": False, "WARP_SPECIALIZE": False}
    signature |= dict.fromkeys(consts, "constexpr")
    source = ASTSource(fn, signature, consts, {})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS, "num_stages": STAGES})


def loop_events(ttgir: str) -> list[str]:
    body = ttgir[ttgir.index("scf.for") :]
    events = []
    for line in body.splitlines():
        if "ttng.warp_group_dot_wait" in line:
            pendings = re.search(r"pendings = (\d+)", line)
            events.append(f"wait (pendings {pendings.group(1) if pendings else '?'})")
        elif "ttng.warp_group_dot " in line:
            name = line.strip().split(" = ")[0]
            events.append(f"wgmma {name} ({'async' if 'isAsync = true' in line else 'sync'})")
        elif "math.exp2" in line:
            events.append("exp2")
        elif "scf.yield" in line:
            events.append("end of iteration")
            break
    return events


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, {BLOCK_M}x{BLOCK_N} tiles, {WARPS} warps, {STAGES} stages")
    for name in ("products", "softmax", "pipelined"):
        kernel = compiled(name)
        ptx = kernel.asm["ptx"]
        waits = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)))
        print(f"{name}: " + " -> ".join(loop_events(kernel.asm["ttgir"])))
        print(f"  ptx: {ptx.count('wgmma.mma_async')} wgmma.mma_async, wait_group N for N in {waits}")


if __name__ == "__main__":
    main()
