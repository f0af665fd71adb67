"""Diagnostics for the CUDA decode kernel on a GPU: its per-warp partials against float64, and where its time goes.

    PYTHONPATH=kernels python kernels/bench/decode_mma_probe.py [--no-time] [--pages]

1. Partials: for small cases, every warp's (running max, running sum, unnormalised output) is compared with the same
   quantities computed in float64 from the definition, so a wrong index shows up as the first mismatching part/row.
2. Time split: the kernel at 131,072 tokens as built, and two variants of its source with stages left out (copies
   only; copies and Q·K^T without P·V), timed the same way: the differences say where the time goes.
3. --pages (alone): the same step over shuffled pages and over pages in order, ours and FA3's.
4. --rows (alone): the cache read with the kernel's copy machinery in rows of 128, 256, 512 or 1024 bytes a copy.
"""

from __future__ import annotations

import ctypes
import math
import sys
from functools import partial

import torch
import triton
from kvkernels import _decode_mma
from kvkernels._cuda_runtime import compile_cubin, load_kernel
from kvkernels.decode import MmaDecodeConfig, PagedKVCache, _mma_partials, paged_decode
from kvkernels.modes import AccumulationMode
from kvkernels.prefill import LOG2_E
from kvkernels.quant import FP8_DTYPE

PAGE, D = 16, 128


def _cache(seqs: int, hk: int, length: int, gen: torch.Generator, shuffled: bool = True) -> tuple[torch.Tensor, ...]:
    pages = -(-length // PAGE)
    shape = (seqs * pages, PAGE, hk, D)
    kc = torch.randn(shape, device="cuda", generator=gen).to(FP8_DTYPE)
    vc = (torch.randn(shape, device="cuda", generator=gen) + 1.0).to(FP8_DTYPE)
    order = torch.randperm(seqs * pages, device="cuda", generator=gen) if shuffled else torch.arange(seqs * pages)
    table = order.to(device="cuda", dtype=torch.int32).view(seqs, pages)
    return kc, vc, table


def expected_partials(q, kc, vc, table, lens, group, parts_per_seq, tokens_per_part, qk_scale):  # type: ignore[no-untyped-def]
    """tokens_per_part: per sequence (splits are cut from each sequence's own length)."""
    seqs, heads, _ = q.shape
    hk = kc.shape[2]
    acc = torch.zeros(seqs, heads, parts_per_seq, D, dtype=torch.float64, device="cuda")
    m = torch.full((seqs, heads, parts_per_seq), -math.inf, dtype=torch.float64, device="cuda")
    s_sum = torch.zeros_like(m)
    for seq in range(seqs):
        n = int(lens[seq])
        pages = table[seq, : -(-n // PAGE)].long()
        k = kc[pages].reshape(-1, hk, D)[:n].double()
        v = vc[pages].reshape(-1, hk, D)[:n].double()
        for part in range(parts_per_seq):
            lo, hi = part * tokens_per_part[seq], min(n, (part + 1) * tokens_per_part[seq])
            if hi <= lo:
                continue
            for head in range(heads):
                kv = head // group
                s = (k[lo:hi, kv] @ q[seq, head].double()) * qk_scale
                m[seq, head, part] = s.max()
                p = torch.exp2(s - s.max())
                s_sum[seq, head, part] = p.sum()
                acc[seq, head, part] = p @ v[lo:hi, kv]
    return acc, m, s_sum


def check_partials(
    label: str, seqs: int, hk: int, group: int, lengths: list[int], cfg: MmaDecodeConfig, splits: int
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(len(label))
    kc, vc, table = _cache(seqs, hk, max(lengths), gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, hk * group, D, device="cuda", generator=gen).to(FP8_DTYPE)
    qk_scale = LOG2_E / math.sqrt(D)
    cache = PagedKVCache(kc, vc, table, lens)
    partials = _mma_partials(q, cache, max(lengths), AccumulationMode.TWO_LEVEL, qk_scale, splits, cfg)
    torch.cuda.synchronize()
    # Fixed splits: sequence s owns rows [s * parts, (s + 1) * parts) of the [heads, rows, ...] buffers.
    parts = partials.max_parts
    acc = partials.acc.view(hk * group, seqs, parts, D).transpose(0, 1)
    m = partials.max.view(hk * group, seqs, parts).transpose(0, 1)
    l_sum = partials.sum.view(hk * group, seqs, parts).transpose(0, 1)
    step = cfg.tile * cfg.warps_per_head
    per_part = [-(-n // (splits * step)) * step // cfg.warps_per_head for n in lengths]
    e_acc, e_m, e_l = expected_partials(q, kc, vc, table, lens, group, parts, per_part, qk_scale)
    nan = int(torch.isnan(acc).sum() + torch.isnan(m).sum() + torch.isnan(l_sum).sum())
    dm = (m.double() - e_m).nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    finite = torch.isfinite(e_m)
    dl = ((l_sum.double() - e_l).abs() / e_l.clamp_min(1e-30))[finite].max().item() if finite.any() else 0.0
    da = ((acc.double() - e_acc).norm(dim=-1) / e_acc.norm(dim=-1).clamp_min(1e-30))[finite].max().item()
    print(f"{label}: NaN {nan}; max |dm| {dm:.2e}; max rel dl {dl:.2e}; max rel dacc {da:.2e}", flush=True)
    if nan or dm > 1e-3 or dl > 1e-2 or da > 1e-2:
        bad = (~torch.isclose(m.double(), e_m, atol=1e-3)).nonzero()[:6].tolist()
        print(f"  first bad (seq, head, part) by m: {bad}")
        s, h, p = bad[0] if bad else (0, 0, 0)
        print(f"  m {m[s, h].tolist()} expected {e_m[s, h].tolist()}")
        print(f"  l {l_sum[s, h].tolist()} expected {e_l[s, h].tolist()}")
        print(f"  acc[:8] {acc[s, h, p, :8].tolist()}\n  expected {e_acc[s, h, p, :8].tolist()}")


ECHO_SOURCE = r"""
extern "C" __global__ void paged_decode_fp8_mma(
    const unsigned char* q, const unsigned char* k_cache, const unsigned char* v_cache, const int* block_table,
    const int* seq_lens, float* part_acc, float* part_max, float* part_sum, int* part_index, float qk_scale,
    int group, int tokens_per_split, int seqs, int wave, int most_waves, int min_split_steps, int fixed_splits,
    long long s_qs, long long s_qh, long long s_kb, long long s_kt, long long s_kh, long long s_vb, long long s_vt,
    long long s_vh, long long s_bt, long long s_as, long long s_ah, long long s_ap, long long s_ms, long long s_mh) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        const long long ints[21] = {group, tokens_per_split, seqs, wave, most_waves, min_split_steps, fixed_splits,
                                    s_qs, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_as, s_ah, s_ap, s_ms, s_mh};
        for (int i = 0; i < 21; ++i) part_acc[i] = (float)ints[i];
        part_acc[21] = qk_scale;
        part_acc[22] = (float)seq_lens[0];
        part_acc[23] = (float)block_table[0];
        part_acc[24] = (float)q[0];
        part_acc[25] = (float)k_cache[0];
        part_acc[26] = (float)v_cache[0];
        part_max[0] = 1.f;
        part_sum[0] = 2.f;
        part_index[0] = 3;
    }
}
"""


def check_arguments() -> None:
    """A kernel with the same signature echoes what it receives: the ctypes launch path, checked alone."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    kc, vc, table = _cache(2, 2, 64, gen)
    lens = torch.tensor([64, 33], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, D, device="cuda", generator=gen).to(FP8_DTYPE)
    cubin = compile_cubin(ECHO_SOURCE, "echo.cu", 90, {})
    kernel = load_kernel(cubin, _decode_mma.FUNCTION_NAME, q.device, _decode_mma.SIGNATURE, 0)
    acc = torch.zeros(8, 8, D, device="cuda")
    m = torch.zeros(8, 8, device="cuda")
    l_sum = torch.zeros_like(m)
    index = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
    plan = [96, 2, 132, 4, 128, 0]
    strides = [*q.stride()[:2], *kc.stride()[:3], *vc.stride()[:3], table.stride(0), 4 * D, *acc.stride()[:2], 4,
               m.stride(0)]  # fmt: skip
    args = [q, kc, vc, table, lens, acc, m, l_sum, index, 0.125, 4, *plan, *strides]
    kernel.launch((1, 1, 1), 32, torch.cuda.current_stream().cuda_stream, args)
    torch.cuda.synchronize()
    got = acc.flatten()[:27].tolist()
    want = [4, *plan, *strides, 0.125, 64, int(table[0, 0]), float(q.view(torch.uint8)[0, 0, 0]),
            float(kc.view(torch.uint8).flatten()[0]), float(vc.view(torch.uint8).flatten()[0])]  # fmt: skip
    print(f"arguments echoed: {'ok' if got == [float(w) for w in want] else 'MISMATCH'}\n  got  {got}\n  want {want}")
    print(f"  part_max[0] {m.flatten()[0].item()} part_sum[0] {l_sum.flatten()[0].item()} index {index[0, 0].item()}",
          flush=True)  # fmt: skip


def _variant(source: str, cut: str) -> str:
    """The kernel source with one stage replaced by nothing (markers are comments already in the source)."""
    if cut == "copies-only":
        start = source.index("        // S = Q·K^T for TILE tokens")
        end = source.index("    wait_groups<0>();")
        return source[:start] + "        l_run[0] += 1.f;\n    }\n" + source[end:]
    if cut == "no-pv":
        start = source.index("        // P·V, two-level")
        end = source.index("    wait_groups<0>();")
        return source[:start] + "        out[0][0] += pa[0][0];\n    }\n" + source[end:]
    return source


def time_split(length: int = 131072, seqs: int = 16, hk: int = 8, group: int = 4) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    kc, vc, table = _cache(seqs, hk, length, gen)
    lens = torch.full((seqs,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, hk * group, D, device="cuda", generator=gen).to(FP8_DTYPE)
    cache = PagedKVCache(kc, vc, table, lens)
    kv_bytes = 2 * seqs * length * hk * D
    configs = (
        MmaDecodeConfig(),
        MmaDecodeConfig(tile=32, stages=3, heads_per_block=8, blocks_per_multiprocessor=2),
        MmaDecodeConfig(tile=32, stages=4, heads_per_block=1, warps_per_head=2, blocks_per_multiprocessor=8),
    )
    for cfg in configs:
        key_consts = _decode_mma.defines(cfg, D, PAGE, hk, group)
        for cut in ("as-built", "copies-only", "no-pv"):
            cubin = compile_cubin(_variant(_decode_mma.source(), cut), "v.cu", 90, key_consts)
            shared = cfg.shared_bytes(D, hk)
            kernel = load_kernel(cubin, _decode_mma.FUNCTION_NAME, q.device, _decode_mma.SIGNATURE, shared)
            index = torch.cuda.current_device()
            _decode_mma._kernels[(index, tuple(sorted(key_consts.items())))] = kernel
            ms = triton.testing.do_bench(
                partial(paged_decode, q, cache, max_seq_len=length, config=cfg),
                warmup=25,
                rep=200,
                return_mode="median",
            )
            print(f"{cfg} {cut}: {ms * 1e3:.0f} us, {kv_bytes / ms / 1e6:.0f} GB/s", flush=True)
        _decode_mma._kernels.clear()


def page_order(length: int = 131072, seqs: int = 16, hk: int = 8, group: int = 4) -> None:
    """The same decode step over shuffled pages (as the benchmarks) and over pages in order: how much of the FP8
    kernels' gap to the copy bandwidth is the scattered 128-byte rows of a paged cache. FA3 too, when importable."""
    import fa3_peer

    kv_bytes = 2 * seqs * length * hk * D
    for shuffled in (True, False):
        gen = torch.Generator(device="cuda").manual_seed(5)
        kc, vc, table = _cache(seqs, hk, length, gen, shuffled)
        lens = torch.full((seqs,), length, dtype=torch.int32, device="cuda")
        q = torch.randn(seqs, hk * group, D, device="cuda", generator=gen).to(FP8_DTYPE)
        cache = PagedKVCache(kc, vc, table, lens)
        fns = {"CUDA (mma)": partial(paged_decode, q, cache, max_seq_len=length, config=MmaDecodeConfig())}
        if fa3_peer.available()[0]:
            fns["FA3 FP8"] = fa3_peer.decode_fns(q, cache, length)["fa3-scheduled"]
        for name, fn in fns.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            order = "shuffled" if shuffled else "in order"
            print(f"pages {order}: {name} {ms * 1e3:.0f} us, {kv_bytes / ms / 1e6:.0f} GB/s", flush=True)
        del kc, vc, cache
        torch.cuda.empty_cache()


STREAM_SOURCE = r"""
// Reads a paged cache's K and V rows the way the decode kernel does (cp.async, 16 bytes a lane, STAGES deep into
// shared memory), but HPW adjacent KV heads per warp: each copy instruction covers HPW * 128 contiguous bytes of a
// token row. Only the bytes' XOR survives, so nothing but the reading is timed.
typedef unsigned int u32;
extern "C" __global__ void __launch_bounds__(128) stream_rows(
    const unsigned char* k_cache, const unsigned char* v_cache, const int* table, int tokens_per_warp,
    int pages_per_seq, long long s_kb, long long s_kt, long long s_kh, u32* sink) {
    extern __shared__ __align__(16) unsigned char shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seq = blockIdx.z, head0 = blockIdx.y * HPW;
    const int start = (blockIdx.x * 4 + warp) * tokens_per_warp;
    const int tiles = tokens_per_warp / TOKENS;
    const int span = HPW * 128;                          // contiguous bytes of one token row
    const int units = 2 * TOKENS * span / 16 / 32;      // 16-byte copies per lane per tile (keys and values)
    u32 smem;
    asm("{.reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t;}" : "=r"(smem) : "l"(shared));
    smem += warp * STAGES * units * 512 + lane * 16;
    auto issue = [&](int tile) {
        for (int u = 0; u < units; ++u) {
            const int linear = (u * 32 + lane) * 16;         // byte of the tile: [keys|values][token][span]
            const int half = linear / (TOKENS * span), rest = linear % (TOKENS * span);
            const int tok = start + tile * TOKENS + rest / span;
            const long long page = table[seq * pages_per_seq + tok / 16];
            const unsigned char* src =
                (half ? v_cache : k_cache) + page * s_kb + (tok % 16) * s_kt + head0 * s_kh + rest % span;
            const u32 dst = smem + ((tile % STAGES) * units + u) * 512;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
        }
    };
    u32 acc = 0;
    for (int p = 0; p < STAGES - 1; ++p) { if (p < tiles) issue(p); asm volatile("cp.async.commit_group;"); }
    for (int tile = 0; tile < tiles; ++tile) {
        if (tile + STAGES - 1 < tiles) issue(tile + STAGES - 1);
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
        for (int u = 0; u < units; ++u) {
            u32 a, b, c, d;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                         : "r"(smem + ((tile % STAGES) * units + u) * 512));
            acc ^= a ^ b ^ c ^ d;
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
"""


def row_streaming(length: int = 131072, seqs: int = 16, hk: int = 8) -> None:
    """Bandwidth of reading the paged FP8 cache in rows of 128 (one KV head), 256 (two) or 1024 bytes (eight) per
    copy instruction, with the decode kernel's copy machinery: isolates the row width from everything else."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    kc, vc, table = _cache(seqs, hk, length, gen)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * seqs * length * hk * D
    p32, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    signature = (p32, p32, p32, i32, i32, i64, i64, i64, p32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for hpw in (1, 2, 4, 8):
        tokens = 32 // hpw  # 8 KiB of keys and values per tile in every variant
        stages = 3
        shared = 4 * stages * 2 * tokens * hpw * 128
        cubin = compile_cubin(STREAM_SOURCE, "stream.cu", 90, {"HPW": hpw, "TOKENS": tokens, "STAGES": stages})
        kernel = load_kernel(cubin, "stream_rows", torch.device("cuda"), signature, shared)
        head_groups = hk // hpw
        splits = max(1, 4 * sms // (seqs * head_groups))
        per_warp = length // (splits * 4)
        per_warp -= per_warp % tokens
        stream = torch.cuda.current_stream().cuda_stream
        args = [kc, vc, table, per_warp, table.shape[1], kc.stride(0), kc.stride(1), kc.stride(2), sink]
        fn = partial(kernel.launch, (splits, head_groups, seqs), 128, stream, args)
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        read = kv_bytes * (splits * 4 * per_warp) / length
        print(f"rows of {hpw * 128} bytes per copy: {ms * 1e3:.0f} us, {read / ms / 1e6:.0f} GB/s", flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "--rows" in sys.argv:
        row_streaming()
        return
    if "--pages" in sys.argv:
        page_order()
        time_split()
        return
    check_arguments()
    check_partials("1 seq, 1 tile, 1 warp", 1, 1, 4, [32], MmaDecodeConfig(tile=32, stages=2), 1)
    check_partials("1 seq, 3 tiles, 1 warp", 1, 1, 4, [96], MmaDecodeConfig(tile=32, stages=2), 1)
    check_partials("masked tail", 1, 1, 4, [77], MmaDecodeConfig(tile=32, stages=3), 1)
    check_partials("2 seqs, 2 kv heads, 2 slices, 2 splits", 2, 2, 4, [1000, 517], MmaDecodeConfig(warps_per_head=2), 2)
    check_partials("8 kv heads, group 12", 2, 8, 12, [300, 64], MmaDecodeConfig(), 1)
    if "--no-time" not in sys.argv:
        time_split()


if __name__ == "__main__":
    main()
