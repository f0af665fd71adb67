"""The CUDA decode kernel's logic on the CPU, through its model (mma_decode_model.py) against the float64 reference.

Every case builds a cache the way a server leaves it: pages shuffled, NaN in every slot past a sequence's end, the
block table a slice of a wider one (row stride != width) with poison page ids past each sequence's pages. The model
must then match the reference within a bound derived from its roundings, per row. test_gpu.py ties the model to the
kernel on a GPU (same grid), and the mutation test shows that this grid catches small slips in the model's indexing.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field, replace
from pathlib import Path

import mma_decode_model
import pytest
import torch
from kvkernels._decode_mma import LaunchPlan, MmaDecodeConfig, plan_launch, sequence_splits
from kvkernels.decode import MmaPartials, PagedKVCache, build_paged_cache
from kvkernels.quant import FP8_DTYPE, quantize_fp8
from kvkernels.reference import paged_decode_reference, value_spread

DEVICE = MmaDecodeConfig(plan_on_device=True)  # splits planned by the kernel from seq_lens
POISON_PAGE = 2**30  # a page id no cache has: reading it fails (model: IndexError; GPU: illegal address)
F16_UNIT = 2.0**-11  # largest relative rounding error of P's f32 -> f16 conversion
F16_SUBNORMAL_STEP = 2.0**-25  # absolute error below f16's smallest normal (2^-14)
FP32_UNIT = 2.0**-24


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    page: int = 16
    kv_heads: int = 2
    group: int = 4
    head_dim: int = 128
    config: MmaDecodeConfig = field(default_factory=MmaDecodeConfig)
    num_splits: int | None = None  # None: the kernel's own choice (plan_launch) for these multiprocessors
    multiprocessors: int = mma_decode_model.H200_MULTIPROCESSORS
    resident_blocks: int = mma_decode_model.H200_RESIDENT_BLOCKS


# Lengths around pages (1, P-1, P, P+1), around split and slice boundaries, odd ones; few, one and many splits.
CASES = [
    Case("page-edges-auto-splits", (1, 15, 16, 17, 31, 33, 77)),
    Case("page-32", (1, 31, 32, 33, 95), page=32, num_splits=2),
    Case("split-boundaries-112", (111, 112, 113, 224, 225, 300), num_splits=3),
    Case("one-split-long", (1, 700, 1201), num_splits=1),
    Case("many-splits-mostly-empty", (5, 400, 1023), num_splits=64),
    Case("two-slices-tile-64", (1, 63, 64, 65, 129, 200, 401), num_splits=2,
         config=MmaDecodeConfig(tile=64, heads_per_block=1, warps_per_head=2)),
    Case("three-slices", (1, 47, 48, 49, 150), config=MmaDecodeConfig(heads_per_block=2, warps_per_head=3)),
    Case("gqa-1", (1, 17, 260), kv_heads=4, group=1, config=MmaDecodeConfig(stages=4)),
    Case("gqa-8", (3, 16, 333), group=8),
    Case("gqa-12-rows16", (1, 16, 17, 290), group=12),
    Case("gqa-3-kv12-three-blocks", (1, 33, 129), kv_heads=12, group=3, num_splits=2),
    Case("head-dim-256-gqa-16", (1, 15, 17, 250), group=16, head_dim=256, config=MmaDecodeConfig(tile=16)),
    Case("head-dim-256-page-32-tile-32", (2, 32, 97, 161), page=32, head_dim=256, num_splits=3,
         config=MmaDecodeConfig(tile=32)),
    # The host planner's own split counts on a small GPU: whole waves of splits of >= 64 steps (2 SMs x 2 resident
    # blocks, 4 waves: 4 splits of 1,040 tokens of each sequence, the last one short), and one wave of short splits
    # for two sequences (4 x 384).
    Case("planned-waves", (1, 2100, 3000, 4097), multiprocessors=2, resident_blocks=2,
         config=MmaDecodeConfig(blocks_per_multiprocessor=8, min_split_steps=64)),
    Case("planned-one-wave", (1500, 7), group=8, multiprocessors=8),
    # Planned on the device, by length. The same batch: the longest (257 steps) keeps 64 only with 3 waves, whose
    # 12 blocks go 1, 2, 3, 4 to the sequences (6 of the 16 launched idle); then 6 + 1 of 8 blocks (one idle).
    Case("device-planned-waves", (1, 2100, 3000, 4097), multiprocessors=2, resident_blocks=2,
         config=MmaDecodeConfig(blocks_per_multiprocessor=8, min_split_steps=64, plan_on_device=True)),
    Case("device-planned-one-wave", (1500, 7), group=8, multiprocessors=8, config=DEVICE),
    # A long sequence among short ones, two KV-head blocks; page edges (one split a step, most of 132 blocks idle);
    # fixed splits mostly empty; two slices a split.
    Case("device-long-among-short", (1, 2000, 16, 33, 5), kv_heads=4, group=2, multiprocessors=4,
         resident_blocks=2, config=MmaDecodeConfig(heads_per_block=2, min_split_steps=8, plan_on_device=True)),
    Case("device-page-edges", (1, 15, 16, 17, 31, 33, 77), config=DEVICE),
    Case("device-fixed-splits", (5, 400, 1023), num_splits=64, page=32, config=DEVICE),
    Case("device-two-slices", (1, 63, 64, 65, 129, 200, 401), multiprocessors=8,
         config=MmaDecodeConfig(tile=32, heads_per_block=1, warps_per_head=2, plan_on_device=True)),
]  # fmt: skip


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor
    cache: PagedKVCache
    q_scale: float
    k_scale: float
    v_scale: float


def make_inputs(case: Case, seed: int = 0, device: str = "cpu") -> Inputs:
    """Keys and values as a server's cache holds them (V with mean 1, as real V rows have), FP8 with per-tensor
    scales, in shuffled pages; NaN past every end; the table a slice of a wider one, poison past each end."""
    gen = torch.Generator().manual_seed(seed)
    hk, d = case.kv_heads, case.head_dim
    keys = [torch.randn(hk, n, d, generator=gen) for n in case.lengths]
    values = [torch.randn(hk, n, d, generator=gen) + 1.0 for n in case.lengths]
    _, ks = quantize_fp8(torch.cat(keys, 1))
    _, vs = quantize_fp8(torch.cat(values, 1))
    packed = build_paged_cache(
        [quantize_fp8(k, ks)[0] for k in keys], [quantize_fp8(v, vs)[0] for v in values], case.page, gen
    )
    nan = torch.tensor(float("nan")).to(FP8_DTYPE)
    pages = packed.block_table.shape[1]
    wide = torch.full((len(case.lengths), pages + 3), POISON_PAGE, dtype=torch.int32)
    for seq, n in enumerate(case.lengths):
        used = -(-n // case.page)
        wide[seq, :used] = packed.block_table[seq, :used]
        last = int(wide[seq, used - 1])
        packed.key_cache[last, n - (used - 1) * case.page :] = nan
        packed.value_cache[last, n - (used - 1) * case.page :] = nan
    table = wide[:, :pages]
    assert table.stride(0) != table.shape[1]
    q8, qs = quantize_fp8(torch.randn(len(case.lengths), hk * case.group, d, generator=gen))
    cache = PagedKVCache(*(t.to(device) for t in (packed.key_cache, packed.value_cache)), table.to(device),
                         packed.seq_lens.to(device))  # fmt: skip
    return Inputs(q8.to(device), cache, qs, ks, vs)


def rounding_bound(inputs: Inputs, num_parts: int) -> torch.Tensor:
    """[seqs, heads] bound on ‖model - reference‖ from the kernel's roundings: P rounded to f16 (relative error
    ≤ 2^-11, or ≤ 2^-25 absolute below 2^-14) while the row sum keeps the fp32 P (`value_spread`), plus fp32 terms
    (score, exp2, the row sum, one rounding per mma, per tile and per merged split)."""
    c = inputs.cache
    spread, largest = value_spread(
        inputs.q, c.key_cache, c.value_cache, c.block_table, c.seq_lens,
        q_scale=inputs.q_scale, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
    )  # fmt: skip
    n = c.seq_lens.cpu().double()[:, None]
    fp32_terms = (n / 16 + n + num_parts + 2 * inputs.q.shape[2]) * FP32_UNIT
    return spread * (F16_UNIT + fp32_terms) + n * F16_SUBNORMAL_STEP * largest


def check_model(model: types.ModuleType, case: Case, seed: int = 0) -> None:
    """The model of `case` against the float64 reference: every row within its rounding bound, and far from the
    output of another sequence (each sequence sees its own pages only)."""
    inputs = make_inputs(case, seed)
    c = inputs.cache
    out, partials = model.model_paged_decode(
        inputs.q, c, max_seq_len=max(case.lengths), config=case.config, num_splits=case.num_splits,
        multiprocessors=case.multiprocessors, resident_blocks=case.resident_blocks,
        q_scale=inputs.q_scale, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
    )  # fmt: skip
    ref = paged_decode_reference(
        inputs.q, c.key_cache, c.value_cache, c.block_table, c.seq_lens,
        q_scale=inputs.q_scale, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
    )  # fmt: skip
    error = (out.double() - ref).norm(dim=-1)
    bound = rounding_bound(inputs, int(partials.index[:, 1].max()))
    worst = int((error / bound).argmax())
    assert bool((error <= bound).all()), (
        f"{case.name}: row {divmod(worst, error.shape[1])} off by {error.flatten()[worst]:.3e}, "
        f"bound {bound.flatten()[worst]:.3e}"
    )
    assert bool(((ref.roll(1, 0) - ref).norm(dim=-1) > 20 * bound).all())  # the check can tell sequences apart


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_model_matches_float64_reference(case: Case) -> None:
    check_model(mma_decode_model, case)


def test_model_uses_the_kernels_launch_plan() -> None:
    """The blocks' work as the model plans it (mma_decode_model.plan_work, written after the .cu) against the
    package's own planner (`sequence_splits`), for every case of the grid."""
    case = CASES[0]
    inputs = make_inputs(case)
    plan = mma_decode_model.model_launch(inputs.q, inputs.cache, max_seq_len=77, config=case.config)
    # 7 sequences x one block of both KV heads, 5 tiles of 16 in the longest: too short for 128-step splits, so one
    # wave (132 blocks, 18 splits of each sequence) capped at one split per tile.
    assert (plan.grid, plan.tokens_per_split, plan.num_parts, plan.threads) == ((5, 1, 7), 16, 35, 64)
    device = mma_decode_model.model_launch(inputs.q, inputs.cache, max_seq_len=77, config=DEVICE)
    # The same batch planned by length: one split a step (15 of the 132 blocks), the rest idle.
    assert (device.grid, device.num_parts, device.max_parts) == ((132, 1, 1), 132, 5)
    work = mma_decode_model.plan_work(inputs.cache.seq_lens, device)
    assert work.seq[:16].tolist() == [0, 1, 2, 3, 3, 4, 4, 5, 5, 5, 6, 6, 6, 6, 6, -1]
    assert work.split[:15].tolist() == [0, 0, 0, 0, 1, 0, 1, 0, 1, 2, 0, 1, 2, 3, 4]
    expected = {
        "planned-waves": ((4, 1, 4), [4] * 4), "planned-one-wave": ((4, 1, 2), [4, 4]),
        "device-planned-waves": ((16, 1, 1), [1, 2, 3, 4]), "device-planned-one-wave": ((8, 1, 1), [6, 1]),
        "device-long-among-short": ((8, 2, 1), [1, 3, 1, 1, 1]),
    }  # fmt: skip
    for case in CASES:
        inputs = make_inputs(case)
        plan = mma_decode_model.model_launch(
            inputs.q, inputs.cache, max_seq_len=max(case.lengths), config=case.config, num_splits=case.num_splits,
            multiprocessors=case.multiprocessors, resident_blocks=case.resident_blocks,
        )  # fmt: skip
        work = mma_decode_model.plan_work(inputs.cache.seq_lens, plan)
        splits = sequence_splits(case.lengths, plan)
        starts = work.split == 0
        assert work.splits[starts].tolist() == splits, case.name
        assert sum(splits) <= work.seq.shape[0] and bool((work.seq[sum(splits) :] == -1).all()), case.name
        if case.name in expected:
            assert (plan.grid, splits) == expected[case.name], case.name
        if not plan.on_device:
            assert plan.tokens_per_split * plan.grid[0] >= max(case.lengths), case.name


def test_fused_merge_changes_who_merges_not_the_plan() -> None:
    """MmaDecodeConfig(fused_merge=True) (opt-in) cuts every case's work as the default plan does: the same grid,
    splits and partial rows, so the model's partials and merge (model_combine: the reduce kernel's, and the fused
    merge's, weights) stand for both; only one-wave host plans are marked fused."""
    for case in CASES:
        inputs = make_inputs(case)
        plans = [
            mma_decode_model.model_launch(
                inputs.q, inputs.cache, max_seq_len=max(case.lengths), config=replace(case.config, fused_merge=fused),
                num_splits=case.num_splits, multiprocessors=case.multiprocessors, resident_blocks=case.resident_blocks,
            )
            for fused in (False, True)
        ]  # fmt: skip
        assert replace(plans[1], fused=False) == plans[0], case.name
        one_wave = math.prod(plans[0].grid) <= plans[0].wave
        assert plans[1].fused == (one_wave and not case.config.plan_on_device) and not plans[0].fused, case.name


@pytest.mark.parametrize("seed", range(40))
def test_device_plan_of_random_batches_on_an_h200(seed: int) -> None:
    """Random batches (1 to 300 sequences of 0 to 300k tokens, some equal): the model's plan equals the package's,
    never needs more blocks than launched, gives every sequence at least one split and no split is past a step;
    equal lengths keep the host-only planner's split count (`budget // sequences`)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = int(torch.randint(1, 300, (1,), generator=gen))
    longest = int(torch.randint(1, 300_000, (1,), generator=gen))
    lengths = torch.randint(0, longest + 1, (seqs,), generator=gen)
    lengths[0] = longest
    if seed % 4 == 0:
        lengths[:] = longest
    for kv_heads, group in ((8, 4), (16, 8)):
        plan = plan_launch(
            DEVICE, seqs, kv_heads * group, kv_heads, longest, mma_decode_model.H200_MULTIPROCESSORS,
            None, mma_decode_model.H200_RESIDENT_BLOCKS,
        )  # fmt: skip
        work = mma_decode_model.plan_work(lengths.int(), plan)
        splits = sequence_splits(lengths.tolist(), plan)
        assert work.splits[work.split == 0].tolist() == splits
        steps = [-(-n // plan.tokens_per_step) for n in lengths.tolist()]
        assert sum(splits) <= plan.grid[0] and max(splits) <= plan.max_parts  # one slice a split by default
        assert all(1 <= c <= max(1, n) for c, n in zip(splits, steps, strict=True))
        if seed % 4 == 0:  # equal lengths: the host plan's count, which is the planner's before issue 27
            host = plan_launch(
                MmaDecodeConfig(), seqs, kv_heads * group, kv_heads, longest, mma_decode_model.H200_MULTIPROCESSORS,
                None, mma_decode_model.H200_RESIDENT_BLOCKS,
            )  # fmt: skip
            assert set(splits) == {host.grid[0]} == {host_only_splits(seqs * plan.grid[1], steps[0], plan)}


def host_only_splits(units: int, steps: int, plan: LaunchPlan) -> int:
    """The split count of every sequence under the planner before splits were planned on the device (one count for
    all, from the longest): the most whole waves that keep splits of `min_split_steps`, else one wave."""
    for waves in range(plan.most_waves, 0, -1):
        splits = waves * plan.wave // units
        if splits >= 1 and steps >= splits * plan.min_split_steps:
            return splits
    return max(1, min(steps, plan.wave // units))


def test_model_merge_is_the_reduce_kernel(device: str) -> None:
    """The model's merge of the splits against the package's reduce kernel (Triton; the interpreter on a CPU) on the
    same partials, laid out as the kernel writes them: a host plan's rows per sequence with empty splits (running
    max -inf); a device plan's rows placed by the sequences' index, with idle blocks' rows (NaN) between and after
    them, with two KV-head blocks."""
    for case in (CASES[4], CASES[-3], CASES[-4], CASES[-2]):
        inputs = make_inputs(case)
        out, partials = mma_decode_model.model_paged_decode(
            inputs.q, inputs.cache, max_seq_len=max(case.lengths), config=case.config, num_splits=case.num_splits,
            multiprocessors=case.multiprocessors, resident_blocks=case.resident_blocks,
            q_scale=inputs.q_scale, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
        )  # fmt: skip
        idle = bool(partials.max.isnan().any())
        assert idle == (case.config.plan_on_device and case.num_splits is None), case.name
        assert bool((partials.max == float("-inf")).any()) or idle, case.name
        moved = [t.to(device) for t in (partials.acc, partials.max, partials.sum, partials.index)]
        max_parts = int(partials.index[:, 1].max())
        if case.config.plan_on_device:
            reduced = MmaPartials(*moved, max_parts).merge(inputs.v_scale, torch.float32)
        else:  # the kernel writes no index for a host plan: rows [s * parts, (s + 1) * parts)
            reduced = MmaPartials(*moved[:3], None, max_parts).merge(inputs.v_scale, torch.float32)
        torch.testing.assert_close(out, reduced.cpu(), rtol=1e-5, atol=1e-5)


def test_qk_step_order_covers_head_dim_once() -> None:
    for head_dim in (128, 256):
        order = mma_decode_model.qk_step_order(head_dim)
        assert order.shape == (head_dim // 16, 16)
        assert sorted(order.flatten().tolist()) == list(range(head_dim))


# Slips in the kernel's index arithmetic, written into a copy of the model; the grid above must catch each.
MUTANTS = {
    "row in page off by one": (
        "(tile_start[:, None] + tok) % page_size",
        "(tile_start[:, None] + tok + 1) % page_size",
    ),
    "page index off by one": (
        "* torch.arange(tile // MMA_K)) // page_size",
        "* torch.arange(tile // MMA_K) - 1) // page_size",
    ),
    "no clamp to the last page": ("torch.minimum(index, last_page[:, None])", "index"),
    "last page off by one": ("(seq_len - 1) // page_size", "seq_len // page_size"),
    "splits overlap by a token": (
        "end = torch.minimum(seq_len, start + per_warp)",
        "end = torch.minimum(seq_len, start + per_warp + 1)",
    ),
    "partial last tile dropped": ("(end - start + tile - 1) // tile", "(end - start) // tile"),
    "one token past the end": ("tile_start[:, None] + tok < end[:, None]", "tile_start[:, None] + tok <= end[:, None]"),
    "slice start ignores the split": (
        "start = split * tokens_per_split + slice_ * per_warp",
        "start = split * tokens_per_split + slice_ * tile",
    ),
    "tokens per split rounded down": (
        "tokens_per_split = (steps + splits - 1) // splits * plan.tokens_per_step",
        "tokens_per_split = steps // splits * plan.tokens_per_step",
    ),
    "a sequence's first block off by one": ("first = ends[seq] - counts[seq]", "first = ends[seq] - counts[seq] + 1"),
    "block placed in the sequence before": (
        "torch.searchsorted(ends, block, right=True)",
        "torch.searchsorted(ends, block, right=False)",
    ),
    "budget not shared among KV-head blocks": (
        "candidate = waves * plan.wave // kv_blocks",
        "candidate = waves * plan.wave",
    ),
    "index counts splits, not slices": ("work.first[starts] * slices", "work.first[starts]"),
    "merge reads the next block's rows": (
        "rows = slice(first, first + count)",
        "rows = slice(first + 1, first + count + 1)",
    ),
    "GQA heads interleaved": (
        "head = kv_head[:, None] * group + rows",
        "head = kv_head[:, None] + rows * (heads // group)",
    ),
    "KV head of a warp": ("+ warp % plan.heads_in_block", "+ warp // plan.heads_in_block"),
    "running output not rescaled": (
        "out_new = _fp32_add(out.double() * alpha.double()[..., None]",
        "out_new = _fp32_add(out.double()",
    ),
    "running sum not rescaled": ("_fp32_add(l_run.double() * alpha.double()[..., None]", "_fp32_add(l_run.double()"),
    "splits merged unweighted": ("(acc * weight[..., None])", "acc"),
    "split sums merged unweighted": ("(sums * weight).sum(-1)", "sums.sum(-1)"),
    "last tile unmasked": ("last_tile & ~valid[:, None, :]", "last_tile & False"),
}


@pytest.mark.parametrize("mutant", MUTANTS, ids=list(MUTANTS))
def test_grid_catches_a_slip_in_the_model(mutant: str) -> None:
    original, mutated = MUTANTS[mutant]
    source = Path(mma_decode_model.__file__).read_text()
    assert source.count(original) == 1, f"mutant {mutant!r} no longer applies to the model's source"
    name = f"mma_decode_model_mutant_{abs(hash(mutant))}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    try:
        exec(compile(source.replace(original, mutated), name, "exec"), module.__dict__)
        for case in CASES:
            try:
                check_model(module, case)
            except (AssertionError, IndexError):
                return
    finally:
        del sys.modules[name]
    pytest.fail(f"no case of the grid caught the mutant {mutant!r}")
