"""Paged split-KV decode against the float64 reference (CPU interpreter without a GPU, compiled on a GPU).

The interpreter cannot compute in bf16, so these tests keep the products in FP8 (upcast_values=False); the bf16
products are checked on a GPU (test_gpu.py).
"""

import pytest
import torch
from kvkernels.decode import DecodeConfig, build_paged_cache, choose_num_splits, paged_decode
from kvkernels.modes import AccumulationMode
from kvkernels.quant import quantize_fp8
from kvkernels.reference import gather_paged, paged_decode_reference, row_errors

LENGTHS = [5, 77, 130]  # shorter than a page, and not multiples of the page or the tile
PAGE = 16
FP8_PRODUCTS = DecodeConfig(block_n=32, upcast_values=False)


def _sequences(device: str, head_dim: int, hk: int = 2):
    gen = torch.Generator(device=device).manual_seed(head_dim)
    keys = [torch.randn(hk, n, head_dim, device=device, generator=gen) for n in LENGTHS]
    values = [torch.randn(hk, n, head_dim, device=device, generator=gen) for n in LENGTHS]
    return keys, values


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode", [AccumulationMode.SINGLE_LEVEL, AccumulationMode.TWO_LEVEL])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_paged_decode_matches_reference(
    device: str, head_dim: int, mode: AccumulationMode, num_splits: int
) -> None:
    keys, values = _sequences(device, head_dim)
    _, ks = quantize_fp8(torch.cat(keys, 1))
    _, vs = quantize_fp8(torch.cat(values, 1))
    gen = torch.Generator().manual_seed(1)
    cache = build_paged_cache(
        [quantize_fp8(k, ks)[0] for k in keys], [quantize_fp8(v, vs)[0] for v in values], PAGE, gen
    )
    q8, qs = quantize_fp8(torch.randn(len(LENGTHS), 8, head_dim, device=device))
    out = paged_decode(
        q8, cache, max_seq_len=max(LENGTHS), mode=mode, q_scale=qs, k_scale=ks, v_scale=vs,
        out_dtype=torch.float32, num_splits=num_splits, config=FP8_PRODUCTS,
    )  # fmt: skip
    ref = paged_decode_reference(
        q8, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=qs, k_scale=ks, v_scale=vs
    )
    error, _ = row_errors(out, ref)
    assert error < 6e-2
    # Each sequence must see only its own pages: swapping two sequences' outputs is far off.
    swapped, _ = row_errors(out.flip(0), ref)
    assert swapped > 0.3


def test_fp16_baseline_and_automatic_splits(device: str) -> None:
    keys, values = _sequences(device, 64)
    cache = build_paged_cache([k.half() for k in keys], [v.half() for v in values], PAGE)
    q = torch.randn(len(LENGTHS), 4, 64, device=device).half()
    out = paged_decode(q, cache, max_seq_len=max(LENGTHS), out_dtype=torch.float32, config=FP8_PRODUCTS)
    ref = paged_decode_reference(q, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens)
    assert row_errors(out, ref)[0] < 2e-3


def test_build_paged_cache_round_trips() -> None:
    keys, values = _sequences("cpu", 16)
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
    keys, values = _sequences(device, 64)
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
    with pytest.raises(ValueError, match="one values tensor per keys tensor"):
        build_paged_cache(keys, values[:1], PAGE)
