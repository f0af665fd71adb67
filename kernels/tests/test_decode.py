"""Paged split-KV decode against the float64 reference (CPU interpreter without a GPU, compiled on a GPU).

The interpreter cannot compute in bf16, so these tests keep the products in FP8 (upcast_values=False); the bf16
products are checked on a GPU (test_gpu.py).
"""

import pytest
import torch
from kvkernels.decode import (
    DecodeConfig,
    PagedKVCache,
    build_paged_cache,
    choose_num_splits,
    combine_partials,
    paged_decode,
    reduce_shape,
)
from kvkernels.modes import AccumulationMode
from kvkernels.quant import FP8_MAX, quantize_fp8
from kvkernels.reference import gather_paged, paged_decode_reference, row_errors, value_spread

LENGTHS = [5, 77, 130]  # shorter than a page, and not multiples of the page or the tile
PAGE = 16
FP8_PRODUCTS = DecodeConfig(block_n=32, upcast_values=False)


def _sequences(device: str, head_dim: int, hk: int = 2):
    gen = torch.Generator(device=device).manual_seed(head_dim)
    keys = [torch.randn(hk, n, head_dim, device=device, generator=gen) for n in LENGTHS]
    values = [torch.randn(hk, n, head_dim, device=device, generator=gen) for n in LENGTHS]
    return keys, values, gen


# Largest relative error of one fp32 -> e4m3 cast of P: half a step when rounded to nearest, compiled (plus an f16
# step: Triton may round through f16 first); half the value under Triton's interpreter, whose cast drops the carry
# when a value rounds up to a power of two (126.24 -> 64, triton-lang/triton PR #11897).
P_CAST_ERROR = {"cuda": 2.0**-4 + 2.0**-10, "cpu": 2.0**-1}


def _p_rounding_bound(device: str, q8, cache, qs: float, ks: float, vs: float) -> torch.Tensor:
    """[seqs, heads] bound on ‖out - reference‖ when P is cast to e4m3 for P·V (FP8 products). The kernel scales P
    by 448 and casts it (relative error < P_CAST_ERROR; < 2^-9 absolute below e4m3's smallest normal 2^-6), while the
    row sum keeps the fp32 P (`value_spread` gives the bound from these); plus 1e-4 relative for fp32 rounding."""
    spread, largest = value_spread(
        q8, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=qs, k_scale=ks, v_scale=vs
    )
    lengths = cache.seq_lens.cpu().double()[:, None]
    return (P_CAST_ERROR[device] + 1e-4) * spread + lengths * 2.0**-9 / FP8_MAX * largest


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode", [AccumulationMode.SINGLE_LEVEL, AccumulationMode.TWO_LEVEL])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_paged_decode_matches_reference(
    device: str, head_dim: int, mode: AccumulationMode, num_splits: int
) -> None:
    keys, values, gen = _sequences(device, head_dim)
    _, ks = quantize_fp8(torch.cat(keys, 1))
    _, vs = quantize_fp8(torch.cat(values, 1))
    cache = build_paged_cache(
        [quantize_fp8(k, ks)[0] for k in keys],
        [quantize_fp8(v, vs)[0] for v in values],
        PAGE,
        torch.Generator().manual_seed(1),
    )
    q8, qs = quantize_fp8(torch.randn(len(LENGTHS), 8, head_dim, device=device, generator=gen))
    out = paged_decode(
        q8, cache, max_seq_len=max(LENGTHS), mode=mode, q_scale=qs, k_scale=ks, v_scale=vs,
        out_dtype=torch.float32, num_splits=num_splits, config=FP8_PRODUCTS,
    )  # fmt: skip
    ref = paged_decode_reference(
        q8, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=qs, k_scale=ks, v_scale=vs
    )
    # Every row within the bound of P's e4m3 cast, the dominant error here (a mean-error tolerance of 6e-2 with an
    # unseeded q failed once on the CPU: the interpreter's cast, P_CAST_ERROR, gives a heavy tail).
    error = (out.double() - ref).norm(dim=-1).cpu()
    bound = _p_rounding_bound(device, q8, cache, qs, ks, vs)
    assert bool((error <= bound).all()), (error / bound).max()
    # Each sequence must see only its own pages: swapping two sequences' outputs is far off.
    swapped, _ = row_errors(out.flip(0), ref)
    assert swapped > 0.3


def test_fp16_baseline_and_automatic_splits(device: str) -> None:
    keys, values, _ = _sequences(device, 64)
    cache = build_paged_cache([k.half() for k in keys], [v.half() for v in values], PAGE)
    q = torch.randn(len(LENGTHS), 4, 64, device=device).half()
    out = paged_decode(q, cache, max_seq_len=max(LENGTHS), out_dtype=torch.float32, config=FP8_PRODUCTS)
    ref = paged_decode_reference(q, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens)
    assert row_errors(out, ref)[0] < 2e-3


def test_build_paged_cache_round_trips() -> None:
    keys, values, _ = _sequences("cpu", 16)
    cache = build_paged_cache(keys, values, PAGE, torch.Generator().manual_seed(0))
    assert cache.seq_lens.tolist() == LENGTHS
    used = cache.block_table[cache.block_table >= 0].unique()
    assert cache.key_cache.shape[0] == sum(-(-n // PAGE) for n in LENGTHS)
    for seq, (k, v) in enumerate(zip(keys, values, strict=True)):
        torch.testing.assert_close(gather_paged(cache.key_cache, cache.block_table[seq], LENGTHS[seq]), k)
        torch.testing.assert_close(gather_paged(cache.value_cache, cache.block_table[seq], LENGTHS[seq]), v)
    assert used.numel() == cache.key_cache.shape[0]


def test_choose_num_splits() -> None:
    assert choose_num_splits(seqs=16, kv_heads=8, max_len=131072, block_n=128, target_programs=528) == 5
    assert choose_num_splits(seqs=1, kv_heads=1, max_len=100, block_n=128, target_programs=528) == 1
    assert choose_num_splits(seqs=256, kv_heads=8, max_len=131072, block_n=128, target_programs=528) == 1


def test_rejects_invalid_inputs(device: str) -> None:
    keys, values, _ = _sequences(device, 64)
    cache = build_paged_cache([k.half() for k in keys], [v.half() for v in values], PAGE)
    q = torch.randn(len(LENGTHS), 4, 64, device=device).half()
    with pytest.raises(ValueError, match="fit the block table"):
        paged_decode(q, cache, max_seq_len=10_000)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode(q.float(), cache, max_seq_len=130)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode(q[:2], cache, max_seq_len=130)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        paged_decode(q[:, :3], cache, max_seq_len=130)
    strided = PagedKVCache(cache.key_cache, cache.value_cache, cache.block_table.repeat(1, 2)[:, ::2], cache.seq_lens)
    with pytest.raises(ValueError, match="block_table must be contiguous along its pages"):
        paged_decode(q, strided, max_seq_len=130)
    with pytest.raises(ValueError, match="one values tensor per keys tensor"):
        build_paged_cache(keys, values[:1], PAGE)


@pytest.mark.parametrize("splits", [5, 300])
def test_reduce_merges_splits_in_chunks(device: str, splits: int) -> None:
    """The reduce kernel against a float64 merge, with running maxima that grow from split to split (so what was
    merged of an earlier chunk is rescaled when a later one brings a larger max), empty splits (max -inf, sum 0), and
    (300) more splits than one chunk of the kernel holds."""
    gen = torch.Generator().manual_seed(splits)
    seqs, heads, head_dim = 2, 3, 64
    acc = torch.randn(seqs, heads, splits, head_dim, generator=gen)
    maxima = torch.linspace(-20.0, 20.0, splits).repeat(seqs, heads, 1)
    maxima += torch.randn(seqs, heads, splits, generator=gen)
    sums = torch.rand(seqs, heads, splits, generator=gen) + 0.5
    maxima[..., 1::7], sums[..., 1::7], acc[..., 1::7, :] = float("-inf"), 0.0, 0.0
    out = combine_partials(acc.to(device), maxima.to(device), sums.to(device), 0.5, torch.float32)
    m64 = maxima.double()
    weight = torch.where(m64 > float("-inf"), torch.exp2(m64 - m64.amax(-1, keepdim=True)), 0.0)
    ref = (acc.double() * weight[..., None]).sum(-2) * (0.5 / (sums.double() * weight).sum(-1))[..., None]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-6)


def test_reduce_reads_every_split_at_once_up_to_two_h200_waves() -> None:
    assert reduce_shape(132, 128) == (256, 16)  # one wave of an H200: one chunk
    assert reduce_shape(264, 128) == (256, 16)  # two waves: two chunks
    assert reduce_shape(66, 256) == (128, 32)
    assert reduce_shape(2, 128) == (2, 32)
    assert reduce_shape(1, 256) == (1, 32)
    assert reduce_shape(5000, 128, most_splits=1024) == (1024, 8)  # never under one 32-byte sector a row
