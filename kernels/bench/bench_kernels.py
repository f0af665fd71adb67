"""H200 benchmarks of kvkernels: prefill TFLOP/s, decode time and bandwidth, accuracy against length.

Run on a CUDA GPU from the repository root:  PYTHONPATH=kernels python kernels/bench/bench_kernels.py --out DIR
Writes DIR/bench.json (every number) and DIR/bench.md (the tables for kernels/BENCHMARKS.md), section by section.
Kernels are compiled first in a pool of processes (Triton's disk cache is shared), then timed one at a time with
triton.testing.do_bench (median of the repeats, after warm-up). Whenever `vllm.vllm_flash_attn` is importable (a vLLM
install, or kernels/tools/prepare_fa3.py's stand-in), vLLM's own FlashAttention-3 runs beside our kernels on the same
inputs in the same process, and every table gives our figures as a ratio to it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import fa3_peer
import torch
import triton
from kvkernels.decode import DecodeConfig, MmaDecodeConfig, PagedKVCache, build_paged_cache, paged_decode
from kvkernels.modes import AccumulationMode
from kvkernels.prefill import TileConfig, attention_prefill, tokens_contiguous
from kvkernels.probe import measure_length, probe_lengths, vllm_fa3_attention
from kvkernels.quant import FP8_DTYPE, quantize_fp8
from kvkernels.reference import paged_decode_reference, row_errors
from torch.nn.attention import SDPBackend, sdpa_kernel

F = torch.nn.functional
MODES = [AccumulationMode.SINGLE_LEVEL, AccumulationMode.TWO_LEVEL, AccumulationMode.TWO_LEVEL_SPLIT]
PREFILL_CONFIGS = {
    64: [TileConfig(64, 128, 4, 3), TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3)],
    128: [
        TileConfig(64, 128, 4, 3),
        TileConfig(128, 64, 4, 3),
        TileConfig(128, 128, 8, 3),
        TileConfig(64, 64, 4, 3),
        TileConfig(64, 128, 4, 4),
        TileConfig(128, 128, 8, 2),
        TileConfig(128, 64, 8, 3),
        TileConfig(64, 128, 4, 2),
        TileConfig(128, 128, 4, 2),
    ],
    256: [
        TileConfig(128, 128, 8, 3),
        TileConfig(128, 64, 8, 2),
        TileConfig(64, 128, 4, 3),
        TileConfig(64, 64, 4, 2),
        TileConfig(128, 128, 8, 2),
    ],
}
DECODE_CONFIGS = [
    DecodeConfig(block_n, warps, stages, upcast_values=False)
    for block_n, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 2, 3), (256, 8, 2), (64, 4, 1), (128, 4, 1),
                                   (128, 8, 1), (256, 4, 1))
]  # fmt: skip
# FP8 caches: products in FP8 (mma.sync on converted operands), or keys and/or values converted to bf16 first.
UPCASTS = ((False, False), (False, True), (True, True))
DECODE_SPLIT_TARGETS = (4, 8, 16)  # programs per multiprocessor
# The CUDA kernel: (tokens per step, copy stages, KV heads per block, warps per KV head, blocks aimed for per SM).
MMA_CONFIGS = [
    MmaDecodeConfig(*shape)
    for shape in ((32, 3, 4, 1, 4), (32, 3, 2, 2, 8), (16, 2, 8, 1, 4), (16, 4, 4, 2, 2), (32, 3, 8, 1, 2),
                  (32, 4, 4, 1, 3), (32, 2, 4, 1, 4), (16, 4, 4, 1, 4), (64, 2, 4, 1, 2), (32, 3, 1, 4, 4),
                  (32, 3, 4, 1, 6), (32, 3, 2, 1, 8))
]  # fmt: skip
SHARED_LIMIT = 227 * 1024


def bench_ms(fn: Callable[[], Any], rep: int = 200) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


class Results:
    """Every number, saved to JSON after each section so a cut-off run still returns what it measured."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {}
        self.markdown: list[str] = []

    def save(self) -> None:
        (self.out / "bench.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "bench.md").write_text("\n".join(self.markdown) + "\n")

    def table(self, title: str, header: list[str], rows: list[list[str]]) -> None:
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        self.markdown += [*lines, ""]
        print("\n".join(lines), flush=True)
        self.save()


# --- prefill ---------------------------------------------------------------------------------------------------


def prefill_shape(causal: bool) -> tuple[int, int, int, int]:
    """(query heads, kv heads, Lq, Lk): non-causal as in the reference probe, causal as one 32k GQA prompt."""
    return (32, 8, 32768, 32768) if causal else (8, 8, 8192, 65536)


def prefill_inputs(head_dim: int, causal: bool, fp8: bool) -> tuple[torch.Tensor, ...]:
    hq, hk, lq, lk = prefill_shape(causal)
    gen = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    q = torch.randn(1, hq, lq, head_dim, device="cuda", generator=gen)
    k = torch.randn(1, hk, lk, head_dim, device="cuda", generator=gen)
    v = torch.randn(1, hk, lk, head_dim, device="cuda", generator=gen) + 1.0
    if fp8:
        return quantize_fp8(q)[0], quantize_fp8(k)[0], tokens_contiguous(quantize_fp8(v)[0])
    return tuple(x.to(torch.bfloat16) for x in (q, k, v))


def prefill_flops(head_dim: int, causal: bool) -> float:
    hq, _, lq, lk = prefill_shape(causal)
    return 4.0 * hq * lq * lk * head_dim / (2.0 if causal else 1.0)


def _compile_prefill(task: tuple[str, int, bool, TileConfig]) -> tuple[tuple[str, int, bool, TileConfig], str]:
    name, head_dim, causal, cfg = task
    try:
        q, k, v = prefill_inputs(head_dim, causal, name != "triton-bf16")
        mode = AccumulationMode.SINGLE_LEVEL if name == "triton-bf16" else AccumulationMode(name)
        attention_prefill(q, k, v, causal=causal, mode=mode, config=cfg)
        torch.cuda.synchronize()
        return task, "ok"
    except Exception as error:  # recorded: a config that does not fit is skipped, not fatal
        return task, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def _compile_decode(task: tuple[str, DecodeConfig]) -> tuple[tuple[str, DecodeConfig], str]:
    name, cfg = task
    try:
        q, cache, _ = decode_inputs(1024, name != "triton-bf16", seqs=2)
        mode = AccumulationMode.SINGLE_LEVEL if name == "triton-bf16" else AccumulationMode(name)
        paged_decode(q, cache, max_seq_len=1024, mode=mode, config=cfg)
        torch.cuda.synchronize()
        return task, "ok"
    except Exception as error:
        return task, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def precompile(workers: int) -> dict[str, str]:
    """Compiles every variant in parallel processes; returns failures by description."""
    prefill_tasks = [
        (name, d, causal, cfg)
        for d, cfgs in PREFILL_CONFIGS.items()
        for causal in (False, True)
        for name in ["triton-bf16", *[m.value for m in MODES]]
        for cfg in cfgs
    ]
    decode_tasks = [(name, cfg) for name in ("triton-bf16", "single-level", "two-level") for cfg in DECODE_CONFIGS]
    decode_tasks += [
        (name, replace(cfg, upcast_keys=keys, upcast_values=values))
        for name in ("single-level", "two-level")
        for cfg in DECODE_CONFIGS
        for keys, values in UPCASTS[1:]
    ]
    failures = {}
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for task, status in [*pool.map(_compile_prefill, prefill_tasks), *pool.map(_compile_decode, decode_tasks)]:
            if status != "ok":
                failures[repr(task)] = status
    return failures


def _fa3_prefill_case(case: dict[str, Any], head_dim: int, causal: bool, flops: float) -> None:
    """FA3 BF16 and FP8 on the same inputs as our kernels (FP8 with the probe's per-tensor scales of 1)."""
    for label, fp8 in (("fa3-bf16", False), ("fa3-fp8", True)):
        q, k, v = prefill_inputs(head_dim, causal, fp8)
        try:
            fn = fa3_peer.prefill_fn(q, k, v.contiguous(), causal)
            ms = bench_ms(fn)
            case[label] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as error:  # recorded, e.g. a head_dim this FA3 build lacks
            case[label] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
        del q, k, v
        torch.cuda.empty_cache()


def bench_prefill(results: Results, failures: dict[str, str], with_fa3: bool) -> None:
    rows, fa3_rows = [], []
    data: dict[str, Any] = {}
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            flops = prefill_flops(head_dim, causal)
            case: dict[str, Any] = {}
            qb, kb, vb = prefill_inputs(head_dim, causal, fp8=False)
            for backend, label in (
                (SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn"),
                (SDPBackend.FLASH_ATTENTION, "sdpa-flash"),
            ):
                try:
                    with sdpa_kernel([backend]):
                        ms = bench_ms(
                            partial(F.scaled_dot_product_attention, qb, kb, vb, is_causal=causal, enable_gqa=True)
                        )
                    case[label] = {"ms": ms, "tflops": flops / ms / 1e9}
                except Exception as error:
                    case[label] = {"error": f"{type(error).__name__}: {str(error)[:100]}"}
            for name in ["triton-bf16", *[m.value for m in MODES]]:
                fp8 = name != "triton-bf16"
                q, k, v = prefill_inputs(head_dim, causal, fp8) if fp8 else (qb, kb, vb)
                mode = AccumulationMode.SINGLE_LEVEL if not fp8 else AccumulationMode(name)
                timings = {}
                for cfg in PREFILL_CONFIGS[head_dim]:
                    if repr((name, head_dim, causal, cfg)) in failures:
                        continue
                    timings[cfg] = bench_ms(partial(attention_prefill, q, k, v, causal=causal, mode=mode, config=cfg))
                if timings:
                    best = min(timings, key=lambda c: timings[c])
                    case[name] = {
                        "ms": timings[best],
                        "tflops": flops / timings[best] / 1e9,
                        "config": asdict(best),
                        "all": {str(tuple(asdict(c).values())): t for c, t in timings.items()},
                    }
                del q, k, v
            del qb, kb, vb
            torch.cuda.empty_cache()
            if with_fa3:
                _fa3_prefill_case(case, head_dim, causal, flops)
            data[f"d{head_dim}-{'causal' if causal else 'full'}"] = case
            ours = "two-level-split" if head_dim == 256 else "two-level"

            def tf(key: str, case: dict[str, Any] = case) -> str:
                return f"{case[key]['tflops']:.0f}" if "tflops" in case.get(key, {}) else "n/a"

            def ratio(a: str, b: str, case: dict[str, Any] = case) -> str:
                if "ms" in case.get(a, {}) and "ms" in case.get(b, {}):
                    return f"{case[a]['ms'] / case[b]['ms']:.2f}x"
                return "n/a"

            rows.append(
                [str(head_dim), "causal" if causal else "full", tf("sdpa-cudnn"), tf("sdpa-flash"), tf("triton-bf16"),
                 tf("single-level"), tf("two-level"), tf("two-level-split"),
                 ratio("two-level", "single-level"), ratio("two-level-split", "single-level"),
                 ratio("sdpa-cudnn", ours)]
            )  # fmt: skip
            fa3_rows.append(
                [str(head_dim), "causal" if causal else "full", tf(ours), tf("fa3-fp8"), tf("fa3-bf16"),
                 tf("sdpa-cudnn"), ratio("fa3-fp8", ours), ratio("fa3-bf16", ours), ratio("fa3-bf16", "fa3-fp8")]
            )  # fmt: skip
            results.data["prefill"] = data
            results.save()
    results.table(
        "Prefill TFLOP/s (non-causal: 8 heads, 8,192 queries x 65,536 keys; causal: GQA 32/8, one 32,768 prompt)",
        ["head_dim", "mask", "cuDNN bf16", "flash bf16", "Triton bf16", "FP8 1-level", "FP8 2-level",
         "FP8 2-level split", "2-level/1-level time", "split/1-level time", "FP8 2-level speed-up vs cuDNN"],
        rows,
    )  # fmt: skip
    if with_fa3:
        results.table(
            "Prefill beside vLLM's FA3, same inputs, same run (TFLOP/s; speed-up = FA3 time / ours)",
            ["head_dim", "mask", "kvkernels FP8 2-level", "FA3 FP8", "FA3 BF16", "cuDNN BF16",
             "ours vs FA3 FP8", "ours vs FA3 BF16", "FA3 FP8 vs FA3 BF16"],
            fa3_rows,
        )  # fmt: skip


# --- decode ----------------------------------------------------------------------------------------------------

DECODE_SEQS, DECODE_HQ, DECODE_HK, DECODE_D, PAGE = 16, 32, 8, 128, 16


def decode_inputs(length: int, fp8: bool, seqs: int = DECODE_SEQS) -> tuple[torch.Tensor, PagedKVCache, int]:
    """Random paged caches (shuffled pages), every sequence `length` tokens; returns (q, cache, KV bytes)."""
    pages = -(-length // PAGE)
    gen = torch.Generator(device="cuda").manual_seed(length)
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    shape = (seqs * pages, PAGE, DECODE_HK, DECODE_D)
    key_cache = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    value_cache = (torch.randn(shape, device="cuda", generator=gen) + 1.0).to(dtype)
    table = torch.randperm(seqs * pages, device="cuda", generator=gen).to(torch.int32).view(seqs, pages)
    lens = torch.full((seqs,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, DECODE_HQ, DECODE_D, device="cuda", generator=gen).to(dtype)
    kv_bytes = 2 * seqs * length * DECODE_HK * DECODE_D * key_cache.element_size()
    return q, PagedKVCache(key_cache, value_cache, table, lens), kv_bytes


def _sweep_mma(q: torch.Tensor, cache: PagedKVCache, length: int) -> dict[str, float]:
    """µs of each CUDA-kernel launch shape at one length ({} entries for shapes that do not fit or fail)."""
    timings: dict[str, float] = {}
    for cfg in MMA_CONFIGS:
        if cfg.shared_bytes(DECODE_D, DECODE_HK) > SHARED_LIMIT:
            continue
        try:
            ms = bench_ms(partial(paged_decode, q, cache, max_seq_len=length, config=cfg), rep=100)
        except Exception as error:  # recorded in the JSON; a shape that fails is not fatal
            timings[repr(cfg)] = float("nan")
            print(f"mma {cfg}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        timings[repr(cfg)] = ms * 1e3
    return timings


def _fa3_decode_us(q: torch.Tensor, cache: PagedKVCache, length: int) -> dict[str, Any]:
    try:
        fns = fa3_peer.decode_fns(q, cache, length)
        timings = {name: bench_ms(fn) * 1e3 for name, fn in fns.items()}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error)[:160]}"}
    best = min(timings, key=lambda name: timings[name])
    return {"us": timings[best], "best": best, "all": timings}


def bench_decode(results: Results, failures: dict[str, str], copy_gbs: float, with_fa3: bool) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tuned: dict[str, tuple[DecodeConfig, float]] = {}
    # Tune the Triton kernel's tile config and split count at 131,072 tokens, then use the best for every length.
    for name in ("triton-bf16", "triton-fp8"):
        q, cache, _ = decode_inputs(131072, name != "triton-bf16")
        best: tuple[float, DecodeConfig] | None = None
        for cfg in DECODE_CONFIGS:
            for per_sm, (keys, values) in itertools.product(
                DECODE_SPLIT_TARGETS, UPCASTS if name != "triton-bf16" else UPCASTS[:1]
            ):
                compiled_as = replace(cfg, upcast_keys=keys, upcast_values=values)
                if repr(("triton-bf16" if name == "triton-bf16" else "two-level", compiled_as)) in failures:
                    continue
                c = replace(compiled_as, target_programs=per_sm * sms)
                ms = bench_ms(partial(paged_decode, q, cache, max_seq_len=131072, config=c), rep=100)
                if best is None or ms < best[0]:
                    best = (ms, c)
        assert best is not None
        tuned[name] = (best[1], best[0])
        del q, cache
        torch.cuda.empty_cache()
    # The CUDA kernel's launch shapes at 32,768 and 131,072 tokens; the fastest over both (sum of times) is used.
    sweeps = {}
    for length in (32768, 131072):
        q, cache, _ = decode_inputs(length, True)
        sweeps[str(length)] = _sweep_mma(q, cache, length)
        del q, cache
        torch.cuda.empty_cache()
    finite = [c for c in MMA_CONFIGS if all(math.isfinite(sweeps[n].get(repr(c), math.nan)) for n in sweeps)]
    mma_cfg = min(finite, key=lambda c: sum(sweeps[n][repr(c)] for n in sweeps)) if finite else MmaDecodeConfig()
    rows, fa3_rows = [], []
    data: dict[str, Any] = {
        "tuned": {k: asdict(v[0]) for k, v in tuned.items()},
        "mma_sweep_us": sweeps,
        "mma_config": asdict(mma_cfg),
    }
    for length in (8192, 32768, 131072, 262144):
        row: dict[str, Any] = {}
        for name, fp8, cfg in (
            ("triton-bf16", False, tuned["triton-bf16"][0]),
            ("triton-fp8", True, tuned["triton-fp8"][0]),
            ("mma-fp8", True, mma_cfg),
            ("mma-fp8-default", True, MmaDecodeConfig()),
        ):
            q, cache, kv_bytes = decode_inputs(length, fp8)
            ms = bench_ms(partial(paged_decode, q, cache, max_seq_len=length, config=cfg))
            row[name] = {"us": ms * 1e3, "gbs": kv_bytes / ms / 1e6, "kv_bytes": kv_bytes}
            if with_fa3:
                fa3 = _fa3_decode_us(q, cache, length)
                if "us" in fa3:
                    fa3["gbs"] = kv_bytes / fa3["us"] / 1e3
                row["fa3-fp8" if fp8 else "fa3-bf16"] = fa3
            del q, cache
            torch.cuda.empty_cache()
        # Anchor: cuDNN SDPA over contiguous BF16 K/V (no paging), the peer a user would pick.
        qs = torch.randn(DECODE_SEQS, DECODE_HQ, 1, DECODE_D, device="cuda", dtype=torch.bfloat16)
        ks = torch.randn(DECODE_SEQS, DECODE_HK, length, DECODE_D, device="cuda", dtype=torch.bfloat16)
        vs = torch.randn_like(ks)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms = bench_ms(partial(F.scaled_dot_product_attention, qs, ks, vs, enable_gqa=True))
            row["sdpa-cudnn-bf16"] = {"us": ms * 1e3, "gbs": 2 * ks.numel() * 2 / ms / 1e6}
        except Exception as error:
            row["sdpa-cudnn-bf16"] = {"error": str(error)[:100]}
        del qs, ks, vs
        torch.cuda.empty_cache()
        data[str(length)] = row

        def us(key: str, row: dict[str, Any] = row) -> str:
            entry = row.get(key, {})
            return f"{entry['us']:,.0f} ({entry['gbs']:,.0f})" if "us" in entry else "n/a"

        def speedup(slow: str, fast: str, row: dict[str, Any] = row) -> str:
            a, b = row.get(slow, {}), row.get(fast, {})
            return f"{a['us'] / b['us']:.2f}x" if "us" in a and "us" in b else "n/a"

        rows.append(
            [f"{length:,}", us("triton-bf16"), us("triton-fp8"), us("mma-fp8"), speedup("triton-bf16", "mma-fp8"),
             f"{row['mma-fp8']['gbs'] / copy_gbs:.0%}", us("sdpa-cudnn-bf16")]
        )  # fmt: skip
        fa3_rows.append(
            [f"{length:,}", us("mma-fp8"), us("fa3-fp8"), us("fa3-bf16"), speedup("fa3-fp8", "mma-fp8"),
             speedup("fa3-bf16", "mma-fp8"), speedup("fa3-fp8", "triton-fp8")]
        )  # fmt: skip
        results.data["decode"] = data
        results.save()
    results.table(
        f"Decode step, {DECODE_SEQS} sequences, GQA {DECODE_HQ}/{DECODE_HK}, head_dim {DECODE_D}, page {PAGE}: "
        f"µs (GB/s of KV read); copy = {copy_gbs:.0f} GB/s read+write; CUDA kernel {mma_cfg}",
        ["context", "Triton BF16", "Triton FP8", "CUDA FP8 (mma)", "FP8 speed-up vs Triton BF16",
         "FP8 GB/s / copy", "cuDNN BF16 SDPA"],
        rows,
    )  # fmt: skip
    if with_fa3:
        results.table(
            "Decode beside vLLM's FA3, same paged caches, same run: µs (GB/s of KV read); speed-up = FA3 time / ours",
            ["context", "kvkernels FP8 (CUDA)", "FA3 FP8", "FA3 BF16", "ours vs FA3 FP8", "ours vs FA3 BF16",
             "Triton FP8 vs FA3 FP8"],
            fa3_rows,
        )  # fmt: skip


# --- accuracy --------------------------------------------------------------------------------------------------


def bench_accuracy(results: Results, max_len: int, with_fa3: bool) -> None:
    rows, data = [], {}
    fa3 = vllm_fa3_attention() if with_fa3 else None
    for head_dim in (64, 128, 256):
        lengths = probe_lengths(4096, max_len) if head_dim == 128 else [131072, max_len]
        for length in lengths:
            entry = {}
            variants = [(mode.value, mode, None) for mode in MODES]
            variants.append(("two-level/64-key tiles", AccumulationMode.TWO_LEVEL, TileConfig(64, 64, 4, 3)))
            for label, mode, cfg in variants:

                def fp8(
                    q: Any,
                    k: Any,
                    v: Any,
                    s: tuple[float, float, float],
                    mode: AccumulationMode = mode,
                    cfg: TileConfig | None = cfg,
                ) -> Any:
                    return attention_prefill(
                        q,
                        k,
                        v,
                        mode=mode,
                        q_scale=s[0],
                        k_scale=s[1],
                        v_scale=s[2],
                        out_dtype=torch.float32,
                        config=cfg,
                    )

                r = measure_length(
                    length, head_dim=head_dim, heads=4, queries=128, v_mean=1.0, device="cuda", seed=1,
                    fp8_attention=fp8, bf16_attention=partial(attention_prefill, out_dtype=torch.float32),
                )  # fmt: skip
                entry[label] = r.as_json()
                torch.cuda.empty_cache()
            if fa3 is not None:
                r = measure_length(
                    length, head_dim=head_dim, heads=4, queries=128, v_mean=1.0, device="cuda", seed=1,
                    fp8_attention=fa3[0], bf16_attention=fa3[1],
                )  # fmt: skip
                entry["FA3 FP8"] = r.as_json()
            data[f"d{head_dim}-{length}"] = entry
            rows.append(
                [str(head_dim), f"{length:,}", f"{entry['two-level']['bf16MeanRelError']:.2e}"]
                + [f"{e['meanRelError']:.2e} ({e['signedShrink']:+.2%})" for e in entry.values()]
            )
            results.data["accuracy_prefill"] = data
            results.save()
    results.table(
        "Prefill accuracy: mean relative error vs float64 (mean signed shrink); 4 heads x 128 queries, V ~ N(1, 1)",
        [
            "head_dim",
            "keys",
            "Triton BF16",
            "FP8 1-level",
            "FP8 2-level",
            "FP8 2-level split",
            "FP8 2-level, 64-key tiles",
            *(["FA3 FP8"] if fa3 is not None else []),
        ],
        rows,
    )


def _fa3_decode_output(q8: torch.Tensor, cache: PagedKVCache, length: int, scales: tuple[float, float, float]) -> Any:
    return fa3_peer.decode_fns(q8, cache, length, scales)["fa3-heuristic"]().float()


def bench_decode_accuracy(results: Results, max_len: int, with_fa3: bool) -> None:
    rows, data = [], {}
    for length in probe_lengths(8192, max_len):
        gen = torch.Generator(device="cuda").manual_seed(length)
        seqs, hq, hk, d = 2, 8, 2, 128
        k = torch.randn(seqs * (length // PAGE), PAGE, hk, d, device="cuda", generator=gen)
        v = torch.randn(seqs * (length // PAGE), PAGE, hk, d, device="cuda", generator=gen) + 1.0
        q = torch.randn(seqs, hq, d, device="cuda", generator=gen)
        (k8, ks), (v8, vs), (q8, qs) = quantize_fp8(k), quantize_fp8(v), quantize_fp8(q)
        table = torch.randperm(k.shape[0], device="cuda", generator=gen).to(torch.int32).view(seqs, -1)
        lens = torch.full((seqs,), length, dtype=torch.int32, device="cuda")
        cache8 = PagedKVCache(k8, v8, table, lens)
        ref = paged_decode_reference(q8, k8, v8, table, lens, q_scale=qs, k_scale=ks, v_scale=vs)
        entry = {}
        variants: list[tuple[str, str, int | None, DecodeConfig | MmaDecodeConfig]] = [
            ("Triton 1-level, 1 split", "single-level", 1, DecodeConfig(upcast_values=False)),
            ("Triton 2-level, auto splits", "two-level", None, DecodeConfig(upcast_values=False)),
            ("Triton 2-level, bf16 products", "two-level", None, DecodeConfig(upcast_keys=True)),
            ("CUDA (mma, f16 products)", "two-level", None, MmaDecodeConfig()),
        ]
        for label, mode, splits, cfg in variants:
            out = paged_decode(
                q8, cache8, max_seq_len=length, mode=mode, q_scale=qs, k_scale=ks, v_scale=vs,
                out_dtype=torch.float32, num_splits=splits, config=cfg,
            )  # fmt: skip
            err, shrink = row_errors(out, ref)
            entry[label] = {"meanRelError": err, "signedShrink": shrink}
        if with_fa3:
            err, shrink = row_errors(_fa3_decode_output(q8, cache8, length, (qs, ks, vs)), ref)
            entry["FA3 FP8"] = {"meanRelError": err, "signedShrink": shrink}
        cacheb = PagedKVCache(k.to(torch.bfloat16), v.to(torch.bfloat16), table, lens)
        qb = q.to(torch.bfloat16)
        refb = paged_decode_reference(qb, cacheb.key_cache, cacheb.value_cache, table, lens)
        errb, _ = row_errors(paged_decode(qb, cacheb, max_seq_len=length, out_dtype=torch.float32), refb)
        data[str(length)] = {"Triton BF16": {"meanRelError": errb}, **entry}
        rows.append(
            [f"{length:,}", f"{errb:.2e}"]
            + [f"{e['meanRelError']:.2e} ({e['signedShrink']:+.2%})" for e in entry.values()]
        )
        del k, v, k8, v8, cache8, cacheb
        torch.cuda.empty_cache()
        results.data["accuracy_decode"] = data
        results.save()
    results.table(
        "Decode accuracy (2 sequences, GQA 8/2, head_dim 128): mean relative error vs float64 (signed shrink)",
        ["context", "Triton BF16", *[label for label, *_ in variants], *(["FA3 FP8"] if with_fa3 else [])],
        rows,
    )


RAGGED_SEQS, RAGGED_MIN, RAGGED_MAX = 16, 1000, 200_000


def bench_decode_ragged(results: Results, with_fa3: bool) -> None:
    """One decode step of a ragged batch (16 lengths spaced evenly in log from 1k to 200k; GQA 32/8, head_dim 128,
    page 16, V ~ N(1, 1)): error against float64 and time, every kernel on the same FP8 cache."""
    ratio = (RAGGED_MAX / RAGGED_MIN) ** (1 / (RAGGED_SEQS - 1))
    lengths = [round(RAGGED_MIN * ratio**i) for i in range(RAGGED_SEQS)]
    gen = torch.Generator(device="cuda").manual_seed(11)
    keys = [torch.randn(DECODE_HK, n, DECODE_D, device="cuda", generator=gen) for n in lengths]
    values = [torch.randn(DECODE_HK, n, DECODE_D, device="cuda", generator=gen) + 1.0 for n in lengths]
    _, ks = quantize_fp8(torch.cat(keys, 1))
    _, vs = quantize_fp8(torch.cat(values, 1))
    cache = build_paged_cache(
        [quantize_fp8(k, ks)[0] for k in keys], [quantize_fp8(v, vs)[0] for v in values], PAGE, torch.Generator()
    )
    del keys, values
    q8, qs = quantize_fp8(torch.randn(RAGGED_SEQS, DECODE_HQ, DECODE_D, device="cuda", generator=gen))
    ref = paged_decode_reference(
        q8, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=qs, k_scale=ks, v_scale=vs
    )
    kv_bytes = 2 * sum(lengths) * DECODE_HK * DECODE_D
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "CUDA FP8 (mma)": partial(
            paged_decode, q8, cache, max_seq_len=RAGGED_MAX, q_scale=qs, k_scale=ks, v_scale=vs,
            out_dtype=torch.float32, config=MmaDecodeConfig(),
        ),
        "Triton FP8": partial(
            paged_decode, q8, cache, max_seq_len=RAGGED_MAX, q_scale=qs, k_scale=ks, v_scale=vs,
            out_dtype=torch.float32, config=DecodeConfig(),
        ),
    }  # fmt: skip
    if with_fa3:
        fns.update(fa3_peer.decode_fns(q8, cache, RAGGED_MAX, (qs, ks, vs)))
    data: dict[str, Any] = {"lengths": lengths}
    for name, fn in fns.items():
        err, shrink = row_errors(fn().float(), ref)
        ms = bench_ms(fn)
        data[name] = {"meanRelError": err, "signedShrink": shrink, "us": ms * 1e3, "gbs": kv_bytes / ms / 1e6}
    results.data["decode_ragged"] = data
    results.save()
    mma = data["CUDA FP8 (mma)"]
    rows = [
        [name, f"{e['meanRelError']:.2e}", f"{e['signedShrink']:+.3%}", f"{e['us']:,.0f}", f"{e['gbs']:,.0f}",
         f"{e['us'] / mma['us']:.2f}x"]
        for name, e in data.items() if name != "lengths"
    ]  # fmt: skip
    results.table(
        f"Ragged decode batch ({RAGGED_SEQS} sequences of {lengths[0]:,}..{lengths[-1]:,} tokens, "
        f"{sum(lengths):,} in all; GQA 32/8, head_dim 128, page 16): error vs float64, time",
        ["kernel", "mean rel. error", "signed shrink", "µs", "GB/s of KV", "time / CUDA kernel's"],
        rows,
    )
    del cache, ref
    torch.cuda.empty_cache()


# --- probe and environment -------------------------------------------------------------------------------------


def bench_probe(results: Results, lengths: list[int], with_fa3: bool) -> None:
    rows, data = [], {}
    runs = [("triton", "single-level"), ("triton", "two-level")] + ([("vllm-fa3", "two-level")] if with_fa3 else [])
    for max_len in lengths:
        for backend, mode in runs:
            cmd = [sys.executable, "-m", "kvkernels.probe", "--max-len", str(max_len), "--head-dim", "128",
                   "--backend", backend, "--mode", mode, "--json"]  # fmt: skip
            started = time.perf_counter()
            done = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "KVPOLICY_TERMINATION_LOG": ""}
            )
            wall = time.perf_counter() - started
            try:
                doc = json.loads(done.stdout)
            except json.JSONDecodeError:
                doc = {"stdout": done.stdout[-500:], "stderr": done.stderr[-1500:]}
            data[f"{max_len}-{backend}-{mode}"] = {"exit": done.returncode, "wall": wall, "result": doc}
            last = (doc.get("lengths") or [{}])[-1]
            rows.append(
                [f"{max_len:,}", backend, doc.get("mode", mode), str(doc.get("verdict")), str(done.returncode),
                 f"{last.get('signedShrink', float('nan')):+.2%}", f"{last.get('meanRelError', float('nan')):.2e}",
                 f"{wall:.1f}"]
            )  # fmt: skip
            results.data["probe"] = data
            results.save()
    results.table(
        "Probe (python -m kvkernels.probe --head-dim 128), lengths 4,096 .. max",
        [
            "max-len",
            "backend",
            "mode",
            "verdict",
            "exit",
            "shrink at max",
            "rel. error at max",
            "wall s (incl. start, compile)",
        ],
        rows,
    )


def environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def copy_bandwidth() -> float:
    x = torch.empty(4 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(partial(y.copy_, x))
    del x, y
    torch.cuda.empty_cache()
    return 2 * 4 * 1024**3 / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default="prefill,decode,ragged,accuracy,probe", help="comma-separated")
    parser.add_argument("--max-len", type=int, default=262144)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    results = Results(args.out)
    results.data["env"] = environment()
    print(results.data["env"], flush=True)
    started = time.perf_counter()
    failures = precompile(args.workers) if sections & {"prefill", "decode"} else {}
    results.data["compile_failures"] = failures
    results.data["compile_seconds"] = time.perf_counter() - started
    print(f"precompiled in {results.data['compile_seconds']:.0f} s; failures: {json.dumps(failures, indent=1)}")
    with_fa3, fa3_note = fa3_peer.available()
    results.data["fa3"] = {"available": with_fa3, "note": fa3_note}
    print(f"vLLM FA3 peer: {with_fa3} ({fa3_note})", flush=True)
    copy_gbs = copy_bandwidth()
    results.data["copy_gbs"] = copy_gbs
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    for name, run in (
        ("decode", lambda: bench_decode(results, failures, copy_gbs, with_fa3)),
        ("ragged", lambda: bench_decode_ragged(results, with_fa3)),
        ("prefill", lambda: bench_prefill(results, failures, with_fa3)),
        (
            "accuracy",
            lambda: (
                bench_accuracy(results, args.max_len, with_fa3),
                bench_decode_accuracy(results, args.max_len, with_fa3),
            ),
        ),
        ("probe", lambda: bench_probe(results, [131072, args.max_len], with_fa3)),
    ):
        if name in sections:
            t0 = time.perf_counter()
            try:
                run()
            except Exception as error:  # keep the other sections' numbers
                results.data[f"{name}_error"] = f"{type(error).__name__}: {error}"
                print(f"section {name} failed: {error!r}", flush=True)
            print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
            results.save()


if __name__ == "__main__":
    main()
