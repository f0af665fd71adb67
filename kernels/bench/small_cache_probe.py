"""Small caches and the device plan (issue 27, third pass): launch and reduce variants beside FA3 at its best.

    PYTHONPATH=kernels:SITE python kernels/bench/small_cache_probe.py --out DIR

For the sweep's head_dim-128 shapes of 1-4 sequences of 32k-64k (the ones under 1.3x FA3 FP8 in the second pass), a
few larger ones and the ragged batches: our decode step (graph replay, do_bench median, L2 cleared) for each of
VARIANTS (a config, -D values added to the kernel's build, and the reduce's chunk of splits), the partial kernel alone
for two of them, every output checked against float64, and FA3 FP8 at its best (decode_sweep.measure_fa3). Writes
DIR/probe.json and prints one line a shape.

Run 1 of 2026-12-02's third pass (bench/results/2026-12-02-h200-issue27-s3-run1-probe.*) timed, beside the default:
the reduce reading 32 splits at a time ("reduce-32"), the prologue's page ids read without waiting for seq_lens
(EARLY_PAGES=1), the device plan with its work passed through redux.sync (UNIFORM_PLAN=1), and two resident blocks an
SM (MIN_BLOCKS=2, 3 and 2 stages). None of those -D switches gained and they were removed from the kernel source;
VARIANTS now holds the partial stores of the second pass (STAGED_STORES=0) and the device plan.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import decode_sweep as sweep
import fa3_peer
import torch
from bench_kernels import environment
from kvkernels import _decode_mma, decode
from kvkernels.decode import MmaDecodeConfig, _mma_partials, qk_log2_scale
from kvkernels.modes import AccumulationMode
from kvkernels.reference import paged_decode_reference

Shape = sweep.Shape
SMALL = [
    Shape((length,) * seqs, hq, 8, 128, page)
    for hq in (32, 64)
    for page in (16, 32)
    for seqs, length in ((1, 32768), (1, 65536), (2, 32768), (2, 65536), (4, 32768))
]
LARGER = [
    Shape((262144,)),
    Shape((131072,) * 16),
    Shape((4096,) * 128),
    Shape((16384,) * 64, 64, 8),
    Shape((131072,) * 2, 64, 8, 256),
    Shape((32768,), 32, 8, 256),
    Shape((65536,) * 8, 8, 4, 256),
    Shape((32768,) * 2, 128, 8, 128),
]
_original_defines = _decode_mma.defines
_original_reduce_shape = decode.reduce_shape
_extra: dict[str, int] = {}


def _defines(*args: Any, **kwargs: Any) -> dict[str, int]:
    return {**_original_defines(*args, **kwargs), **_extra}


_decode_mma.defines = _defines  # kernel_for keys its cache on these: each variant is its own build


@contextmanager
def variant(extra: dict[str, int], reduce_splits: int | None = None) -> Iterator[None]:
    _extra.clear()
    _extra.update(extra)
    if reduce_splits is not None:
        decode.reduce_shape = partial(_original_reduce_shape, most_splits=reduce_splits)
    try:
        yield
    finally:
        _extra.clear()
        decode.reduce_shape = _original_reduce_shape


VARIANTS: dict[str, tuple[dict[str, int], int | None, MmaDecodeConfig]] = {
    "default": ({}, None, MmaDecodeConfig()),
    "unstaged": ({"STAGED_STORES": 0}, None, MmaDecodeConfig()),
    "device": ({}, None, MmaDecodeConfig(plan_on_device=True)),
}


def measure(shape: Shape, seed: int, with_fa3: bool) -> dict[str, Any]:
    q, cache = sweep.make_case(shape, seed)
    max_len = max(shape.lengths)
    ref = paged_decode_reference(
        q, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=1.0, k_scale=1.0, v_scale=1.0
    )
    entry: dict[str, Any] = {"kv_bytes": shape.kv_bytes}
    qk = qk_log2_scale(shape.head_dim, None, 1.0, 1.0)
    for name, (extra, reduce_splits, config) in VARIANTS.items():
        with variant(extra, reduce_splits):
            try:
                result: dict[str, Any] = sweep.errors(
                    sweep.ours_fn(q, cache, max_len, out_dtype=torch.float32, config=config)(), ref
                )
                result["graph"] = sweep.bench_us(sweep.capture(sweep.ours_fn(q, cache, max_len, config=config)).replay)
                if name in ("default", "unstaged"):
                    partials: Callable[[], Any] = partial(
                        _mma_partials, q, cache, max_len, AccumulationMode.TWO_LEVEL, qk, None, config
                    )
                    result["partials"] = sweep.bench_us(sweep.capture(partials).replay)
            except Exception as error:  # recorded, the other variants still run
                result = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        entry[name] = result
    if with_fa3:
        entry["fa3"] = sweep.measure_fa3(q, cache, max_len, ref).get("best", {})
    del q, cache, ref
    torch.cuda.empty_cache()
    return entry


def line(name: str, entry: dict[str, Any]) -> str:
    fa3 = entry.get("fa3", {}).get("graph")
    cells = [name, f"FA3 {fa3:.1f}" if fa3 else "FA3 n/a"]
    for key in VARIANTS:
        r = entry.get(key, {})
        if "graph" not in r:
            cells.append(f"{key} ERR")
            continue
        ratio = f" {fa3 / r['graph']:.2f}x" if fa3 else ""
        extra = f" (partials {r['partials']:.1f})" if "partials" in r else ""
        cells.append(f"{key} {r['graph']:.1f}{ratio}{extra} err {r['worstRowError']:.1e}")
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with_fa3, note = fa3_peer.available()
    data: dict[str, Any] = {"env": environment(), "fa3": note, "shapes": {}}
    print(data["env"], note, flush=True)
    for index, shape in enumerate([*SMALL, *LARGER, *sweep.RAGGED_SHAPES]):
        started = time.perf_counter()
        entry = measure(shape, index, with_fa3)
        data["shapes"][shape.name] = entry
        print(line(shape.name, entry), f"[{time.perf_counter() - started:.1f} s]", flush=True)
        (args.out / "probe.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
