"""GPU-only checks at sizes the interpreter cannot reach: the cliff itself, and accuracy at realistic shapes."""

import os
from functools import partial

import pytest
import torch
from kvkernels import probe
from kvkernels.cuda_graphs import capture
from kvkernels.decode import (
    DecodeConfig,
    MmaDecodeConfig,
    PagedKVCache,
    _mma_partials,
    build_paged_cache,
    default_decode_config,
    mma_launch,
    paged_decode,
    qk_log2_scale,
)
from kvkernels.modes import AccumulationMode
from kvkernels.prefill import attention_prefill
from kvkernels.quant import FP8_DTYPE, quantize_fp8
from kvkernels.reference import attention_reference, paged_decode_reference, row_errors
from mma_decode_model import H200_RESIDENT_BLOCKS, model_launch, model_paged_decode
from test_decode_mma_model import CASES, Case, make_inputs

# Compiled kernels only: under TRITON_INTERPRET=1 even a visible GPU would run the interpreter.
HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The kernel against its CPU model (test_cuda_fp8_decode_matches_its_cpu_model). Measured on an H200 over the grid,
# two seeds (BENCHMARKS.md): running max within 7.2e-7, running sum 3.7e-7 relative; per row of partials and
# outputs, median relative difference <= 9.2e-8 and worst 6.5e-5, where a probability near an f16 rounding midpoint
# went to the other neighbour (one f16 ulp: <= 2^-11 of the row even when that probability is half its weight).
TIE_MAX_ATOL = 2e-6
TIE_SUM_RTOL = 2e-6
TIE_MEDIAN = 1e-6
TIE_WORST = 2.0**-11
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("mode", ["single-level", "two-level"])
def test_probe_sees_the_cliff_only_for_single_level(mode: str) -> None:
    code = probe.main(["--max-len", "16384", "--min-len", "16384", "--head-dim", "128", "--mode", mode])
    assert code == (1 if mode == "single-level" else 0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("lq", "lk"), [(1000, 4099), (1024, 4096)])  # masked tail; whole tiles (diagonal tile)
def test_two_level_prefill_is_accurate_at_4k(head_dim: int, causal: bool, lq: int, lk: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(1, 8, lq, head_dim, device="cuda", generator=gen)
    k = torch.randn(1, 2, lk, head_dim, device="cuda", generator=gen)
    v = torch.randn(1, 2, lk, head_dim, device="cuda", generator=gen) + 1.0
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    ref = attention_reference(q8, k8, v8, causal=causal, q_scale=qs, k_scale=ks, v_scale=vs)
    mode = AccumulationMode.TWO_LEVEL_SPLIT if head_dim == 256 else AccumulationMode.TWO_LEVEL
    out = attention_prefill(q8, k8, v8, causal=causal, mode=mode, q_scale=qs, k_scale=ks, v_scale=vs)
    error, shrink = row_errors(out.float(), ref)
    assert error < 1e-2 and abs(shrink) < 2e-3


@pytest.mark.parametrize("upcast_values", [False, True])
def test_fp8_paged_decode_is_accurate_at_32k(upcast_values: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    seqs, length, page = 3, 32768, 16
    k = torch.randn(seqs * length // page, page, 2, 128, device="cuda", generator=gen)
    v = torch.randn(seqs * length // page, page, 2, 128, device="cuda", generator=gen) + 1.0
    (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
    q8, qs = quantize_fp8(torch.randn(seqs, 8, 128, device="cuda", generator=gen))
    table = torch.randperm(k.shape[0], device="cuda", generator=gen).to(torch.int32).view(seqs, -1)
    lens = torch.tensor([length, 1000, 20001], dtype=torch.int32, device="cuda")
    cache = PagedKVCache(k8, v8, table, lens)
    out = paged_decode(
        q8, cache, max_seq_len=length, q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=torch.float32,
        config=DecodeConfig(upcast_values=upcast_values),
    )  # fmt: skip
    ref = paged_decode_reference(q8, k8, v8, table, lens, q_scale=qs, k_scale=ks, v_scale=vs)
    error, shrink = row_errors(out, ref)
    assert error < 1e-2 and abs(shrink) < 2e-3


def _ragged_fp8_cache(
    lengths: list[int], page: int, hk: int, head_dim: int, seed: int
) -> tuple[PagedKVCache, float, float]:
    """Pages shuffled; every slot past a sequence's end holds NaN, which the kernel must never let in."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    keys = [torch.randn(hk, n, head_dim, device="cuda", generator=gen) for n in lengths]
    values = [torch.randn(hk, n, head_dim, device="cuda", generator=gen) + 1.0 for n in lengths]
    _, ks = quantize_fp8(torch.cat(keys, 1))
    _, vs = quantize_fp8(torch.cat(values, 1))
    cache = build_paged_cache(
        [quantize_fp8(k, ks)[0] for k in keys], [quantize_fp8(v, vs)[0] for v in values], page, torch.Generator()
    )
    nan = torch.tensor(float("nan")).to(FP8_DTYPE)
    for seq, n in enumerate(lengths):
        last = int(cache.block_table[seq, (n - 1) // page])
        cache.key_cache[last, n % page or page :] = nan
        cache.value_cache[last, n % page or page :] = nan
    return cache, ks, vs


@pytest.mark.parametrize(
    ("head_dim", "group", "page", "config"),
    [
        (128, 4, 16, MmaDecodeConfig()),
        (128, 4, 32, MmaDecodeConfig(tile=16, stages=4, heads_per_block=1, blocks_per_multiprocessor=8)),
        (128, 8, 16, MmaDecodeConfig(tile=64, stages=2, heads_per_block=1, warps_per_head=2)),
        (128, 4, 16, MmaDecodeConfig(tile=16, heads_per_block=2, warps_per_head=3)),
        (128, 4, 16, MmaDecodeConfig(heads_per_block=8, blocks_per_multiprocessor=2)),
        (128, 12, 16, MmaDecodeConfig()),  # more than 8 query heads per KV head: all 16 mma rows
        (128, 1, 16, MmaDecodeConfig(stages=4)),
        (256, 4, 16, MmaDecodeConfig(tile=16)),
        (256, 16, 16, MmaDecodeConfig(tile=16, stages=2)),
        (128, 4, 16, MmaDecodeConfig(plan_on_device=True)),
        (128, 4, 32, MmaDecodeConfig(tile=16, heads_per_block=2, warps_per_head=3, plan_on_device=True)),
        (256, 16, 16, MmaDecodeConfig(tile=16, stages=2, plan_on_device=True)),
    ],
)
def test_cuda_fp8_decode_matches_float64_on_a_ragged_batch(
    head_dim: int, group: int, page: int, config: MmaDecodeConfig
) -> None:
    lengths = [1, 15, 16, 17, 1000, 4099, 20001, 65536]
    hk = 2
    cache, ks, vs = _ragged_fp8_cache(lengths, page, hk, head_dim, seed=head_dim + group)
    q8, qs = quantize_fp8(torch.randn(len(lengths), hk * group, head_dim, device="cuda"))
    out = paged_decode(
        q8, cache, max_seq_len=max(lengths), q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=torch.float32,
        config=config,
    )  # fmt: skip
    ref = paged_decode_reference(
        q8, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=qs, k_scale=ks, v_scale=vs
    )
    error, shrink = row_errors(out, ref)
    assert error < 1e-3 and abs(shrink) < 1e-4
    assert row_errors(out.flip(0), ref)[0] > 0.1


def test_fp8_decode_defaults_to_the_cuda_kernel_on_hopper() -> None:
    cache, _, _ = _ragged_fp8_cache([100, 300], 16, 2, 128, seed=3)
    q8, _ = quantize_fp8(torch.randn(2, 8, 128, device="cuda"))
    assert isinstance(default_decode_config(q8, cache), MmaDecodeConfig)
    assert isinstance(default_decode_config(q8, cache, AccumulationMode.SINGLE_LEVEL), DecodeConfig)
    with pytest.raises(ValueError, match="two-level only"):
        paged_decode(q8, cache, max_seq_len=300, mode="single-level", config=MmaDecodeConfig())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_cuda_fp8_decode_matches_its_cpu_model(case: Case) -> None:
    """The kernel and its CPU model (mma_decode_model.py, which the CPU tests hold to the float64 reference) on the
    same inputs: the same launch (the case's GPU's plan, run on this one), the same work planned on the device (the
    rows each sequence's splits wrote), the same partials per split, the same output. They differ only where
    ex2.approx and torch's exp2 round a probability to different f16 neighbours (one f16 ulp, 2^-10 of that
    probability)."""
    inputs = make_inputs(case, seed=1, device="cuda")
    c, max_len = inputs.cache, max(case.lengths)
    plan = model_launch(
        inputs.q, c, max_seq_len=max_len, config=case.config, num_splits=case.num_splits,
        multiprocessors=case.multiprocessors, resident_blocks=case.resident_blocks,
    )  # fmt: skip
    expected, model = model_paged_decode(
        inputs.q, c, max_seq_len=max_len, config=case.config, num_splits=case.num_splits,
        multiprocessors=case.multiprocessors, resident_blocks=case.resident_blocks,
        q_scale=inputs.q_scale, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
    )  # fmt: skip
    qk_scale = qk_log2_scale(case.head_dim, None, inputs.q_scale, inputs.k_scale)
    partials = _mma_partials(inputs.q, c, max_len, AccumulationMode.TWO_LEVEL, qk_scale, None, case.config, plan)
    out = partials.merge(inputs.v_scale, torch.float32).cpu()
    acc, run_max, run_sum = (t.cpu() for t in (partials.acc, partials.max, partials.sum))
    assert acc.shape == model.acc.shape
    if partials.index is not None:  # a device plan's rows of each sequence, as the kernel wrote them
        assert torch.equal(partials.index.cpu(), model.index)
    written = ~model.max.isnan()  # rows of busy blocks (idle blocks write nothing)
    empty = model.max == float("-inf")
    assert torch.equal(run_max[written] == float("-inf"), empty[written])  # the same splits saw no token
    seen = written & ~empty
    torch.testing.assert_close(run_max[seen], model.max[seen], rtol=0.0, atol=TIE_MAX_ATOL)
    torch.testing.assert_close(run_sum[written], model.sum[written], rtol=TIE_SUM_RTOL, atol=0.0)
    for got, want in ((acc[seen], model.acc[seen]), (out, expected)):  # rows of splits that saw tokens
        rel = (got - want).double().norm(dim=-1) / want.double().norm(dim=-1)
        assert float(rel.median()) <= TIE_MEDIAN and float(rel.max()) <= TIE_WORST, (rel.median(), rel.max())


def test_device_plan_follows_seq_lens_changed_under_a_cuda_graph() -> None:
    """The plan on the device is made from seq_lens when the kernel runs: a CUDA graph captured for one batch and
    replayed after seq_lens changed in place (a long sequence among short ones, then lengths the other way round)
    gives what an eager call with the new lengths gives, bit for bit, and matches float64."""
    lengths = [70000, 1, 3000, 16, 40000]
    cache, ks, vs = _ragged_fp8_cache(lengths, 16, 8, 128, seed=11)
    q8, qs = quantize_fp8(torch.randn(len(lengths), 32, 128, device="cuda"))
    config = MmaDecodeConfig(plan_on_device=True)
    step = partial(paged_decode, q8, cache, max_seq_len=max(lengths), q_scale=qs, k_scale=ks, v_scale=vs,
                   out_dtype=torch.float32, config=config)  # fmt: skip
    graph, replayed = capture(step)
    for new in ([70000, 1, 3000, 16, 40000], [1000, 1, 2999, 16, 40000], [5, 1, 1, 1, 1]):
        cache.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        eager = step()
        torch.testing.assert_close(replayed, eager, rtol=0.0, atol=0.0)
        ref = paged_decode_reference(
            q8, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=qs, k_scale=ks,
            v_scale=vs,
        )  # fmt: skip
        assert row_errors(replayed, ref)[0] < 1e-4


@pytest.mark.parametrize("head_dim", [128, 256])
def test_default_launch_keeps_one_block_per_h200_multiprocessor(head_dim: int) -> None:
    """The occupancy the CPU tests' plans assume for an H200 (H200_RESIDENT_BLOCKS), read from the driver."""
    if "H200" not in torch.cuda.get_device_name(0):
        pytest.skip("the constant is an H200's")
    cache, _, _ = _ragged_fp8_cache([100, 300], 16, 8, head_dim, seed=5)
    q8, _ = quantize_fp8(torch.randn(2, 32, head_dim, device="cuda"))
    plan, kernel = mma_launch(q8, cache, 300, MmaDecodeConfig())
    assert kernel.resident_blocks(plan.threads) == H200_RESIDENT_BLOCKS


@pytest.mark.parametrize(
    ("lengths", "kv_heads", "group", "head_dim", "page"),
    [
        ((32768,), 8, 4, 128, 16),  # one sequence: 132 splits, every lane of a merge warp on one vector
        ((20001, 1, 4099, 65536), 8, 8, 128, 32),  # ragged, a sequence of one token (most splits empty)
        ((3000, 17), 2, 12, 256, 16),  # 16 mma rows, head_dim 256, two KV heads a block
        ((40000,) * 8, 4, 2, 128, 16),  # 8 sequences: more vectors than lanes to spare
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_merge_matches_the_reduce_kernel_and_float64(
    lengths: tuple[int, ...], kv_heads: int, group: int, head_dim: int, page: int, out_dtype: torch.dtype
) -> None:
    """A one-wave host plan merges its splits in the partial kernel behind a grid-wide barrier: its output is the
    reduce kernel's (same partials, same weights; merge order and ex2.approx aside) and float64's, eagerly and from a
    CUDA graph replayed with new queries (the barrier's counters go back to 0 after every launch)."""
    cache, ks, vs = _ragged_fp8_cache(list(lengths), page, kv_heads, head_dim, seed=len(lengths) + head_dim)
    q8, qs = quantize_fp8(torch.randn(len(lengths), kv_heads * group, head_dim, device="cuda"))
    fused = MmaDecodeConfig(fused_merge=True)
    plan, _ = mma_launch(q8, cache, max(lengths), fused)
    assert plan.fused
    unfused = partial(paged_decode, q8, cache, max_seq_len=max(lengths), q_scale=qs, k_scale=ks, v_scale=vs,
                      out_dtype=out_dtype)  # fmt: skip
    step = partial(unfused, config=fused)
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-10}[out_dtype]
    graph, replayed = capture(step)
    for round_ in range(3):
        if round_:
            q8.copy_(quantize_fp8(torch.randn_like(q8, dtype=torch.float32), qs)[0])
        graph.replay()
        eager = step()
        torch.testing.assert_close(replayed, eager, rtol=0.0, atol=0.0)
        reduced = unfused()
        rel = (eager.float() - reduced.float()).norm(dim=-1) / reduced.float().norm(dim=-1)
        assert float(rel.max()) <= tolerance, (round_, float(rel.max()))
        ref = paged_decode_reference(
            q8, cache.key_cache, cache.value_cache, cache.block_table, cache.seq_lens, q_scale=qs, k_scale=ks,
            v_scale=vs,
        )  # fmt: skip
        assert row_errors(eager.float(), ref)[0] < max(1e-4, tolerance)
