"""Ablation on an H200: normalise by the sum of the FP8-rounded probabilities (exact_row_sum) or of the fp32 ones?

Run on a CUDA GPU: PYTHONPATH=kernels python kernels/bench/row_sum_ablation.py
Prints accuracy (mean relative error, signed shrink) against length and prefill time for both settings.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import bench_kernels as bench
import torch
import triton
from kvkernels.modes import AccumulationMode
from kvkernels.prefill import TileConfig, attention_prefill
from kvkernels.probe import measure_length

BEST = {
    64: (AccumulationMode.TWO_LEVEL, TileConfig(64, 128, 4, 3)),
    128: (AccumulationMode.TWO_LEVEL, TileConfig(64, 128, 4, 3)),
    256: (AccumulationMode.TWO_LEVEL_SPLIT, TileConfig(128, 128, 8, 3)),
}


def _fp8(
    q: Any, k: Any, v: Any, s: tuple[float, float, float], *, mode: AccumulationMode, cfg: TileConfig, exact: bool
) -> Any:
    return attention_prefill(
        q, k, v, mode=mode, q_scale=s[0], k_scale=s[1], v_scale=s[2], out_dtype=torch.float32, config=cfg,
        exact_row_sum=exact,
    )  # fmt: skip


def accuracy() -> None:
    print("head_dim\tkeys\texact_row_sum\tmeanRelError\tsignedShrink")
    for head_dim, lengths in ((128, (4096, 32768, 131072, 262144)), (64, (131072,)), (256, (131072,))):
        mode, cfg = BEST[head_dim]
        for length in lengths:
            for exact in (False, True):
                fp8 = partial(_fp8, mode=mode, cfg=cfg, exact=exact)
                r = measure_length(
                    length, head_dim=head_dim, heads=4, queries=128, v_mean=1.0, device="cuda", seed=1,
                    fp8_attention=fp8, bf16_attention=partial(attention_prefill, out_dtype=torch.float32),
                )  # fmt: skip
                print(f"{head_dim}\t{length}\t{exact}\t{r.mean_rel_error:.3e}\t{r.signed_shrink:+.4%}", flush=True)


def speed() -> None:
    print("head_dim\tcausal\texact_row_sum\tms\tTFLOP/s")
    for head_dim, (mode, cfg) in BEST.items():
        for causal in (False, True):
            q, k, v = bench.prefill_inputs(head_dim, causal, fp8=True)
            flops = bench.prefill_flops(head_dim, causal)
            for exact in (False, True):
                fn = partial(attention_prefill, q, k, v, causal=causal, mode=mode, config=cfg, exact_row_sum=exact)
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                print(f"{head_dim}\t{causal}\t{exact}\t{ms:.3f}\t{flops / ms / 1e9:.0f}", flush=True)


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    accuracy()
    speed()
