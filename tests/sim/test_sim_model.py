"""The simulator's accuracy and latency models: calibration to the published anchors, and the flag semantics."""

import json
from pathlib import Path

import numpy as np
import pytest
from kvpolicy_dev.numerics import Accumulation
from kvpolicy_dev.sim import accuracy
from kvpolicy_dev.sim.accuracy import NumericsModel, answer_needles
from kvpolicy_dev.sim.config import Gpu, SimConfig
from kvpolicy_dev.sim.latency import HEAD_DIM_256_TWO_LEVEL_PENALTY, latency_fit, sample_latencies

BF16 = SimConfig()
UNFIXED = SimConfig(kv_cache_dtype="fp8")
FIXED = SimConfig(kv_cache_dtype="fp8", two_level_fix=True)


async def probability(config: SimConfig, length: int) -> float:
    capability, survival = await NumericsModel(config).retrieval_probability(length)
    return capability * survival


async def test_128k_scores_match_the_published_niah_anchors() -> None:
    """vLLM blog, 128k NIAH on Hopper: BF16 91%, FP8 unfixed 13%, FP8 with two-level 89%."""
    assert await probability(BF16, 131072) == pytest.approx(0.91, abs=0.01)
    assert await probability(UNFIXED, 131072) == pytest.approx(0.13, abs=0.03)
    assert await probability(FIXED, 131072) == pytest.approx(0.89, abs=0.025)


@pytest.mark.parametrize("length", [8192, 16384, 32768])
async def test_fp8_stays_near_bf16_up_to_32k(length: int) -> None:
    bf16 = await probability(BF16, length)
    assert await probability(UNFIXED, length) > bf16 - 0.03
    assert await probability(FIXED, length) > bf16 - 0.01


async def test_unfixed_accuracy_falls_with_length_through_the_emulated_error() -> None:
    model = NumericsModel(UNFIXED)
    lengths = [16384, 32768, 65536, 131072]
    errors = [await model.attention_error(length) for length in lengths]
    scores = [await probability(UNFIXED, length) for length in lengths]
    assert errors == sorted(errors) and scores == sorted(scores, reverse=True)
    # Between grid points the error is interpolated, so the score moves smoothly rather than stepping.
    assert scores[2] > await probability(UNFIXED, 98304) > scores[3]


async def test_blackwell_and_skipped_layers_escape_the_hopper_shrink() -> None:
    blackwell = SimConfig(kv_cache_dtype="fp8", gpu=Gpu.B200)
    all_skipped = SimConfig(kv_cache_dtype="fp8", num_layers=4, skip_layers=("0", "1", "2", "3"))
    assert await probability(blackwell, 131072) == pytest.approx(await probability(BF16, 131072), abs=0.01)
    assert await probability(all_skipped, 131072) == pytest.approx(0.91, abs=0.01)


async def test_sliding_window_layers_see_only_their_window() -> None:
    # Only the full-attention layers carry the long-context error; the worst layer decides.
    config = SimConfig(kv_cache_dtype="fp8", num_layers=4, sliding_window_layers=3, sliding_window_tokens=1024)
    assert [config.layer_context(layer, 65536) for layer in range(4)] == [1024, 1024, 1024, 65536]
    assert await NumericsModel(config).attention_error(65536) == await NumericsModel(UNFIXED).attention_error(65536)


async def test_uncalibrated_kv_scales_shift_every_length_alike_and_only_fp8_layers() -> None:
    """--kv-scale-error: the same small loss at 16k as at 128k (what the length profile must call systematic)."""
    shifted = SimConfig(kv_cache_dtype="fp8", two_level_fix=True, kv_scale_error=0.30)
    survivals = [(await NumericsModel(shifted).retrieval_probability(n))[1] for n in (16384, 32768, 65536, 131072)]
    assert all(s == pytest.approx(0.982, abs=0.002) for s in survivals)
    assert max(survivals) - min(survivals) < 0.001
    # BF16 layers carry no FP8 scales: a BF16 server, or one whose every layer is skipped, loses nothing.
    assert await probability(SimConfig(kv_scale_error=0.30), 131072) == await probability(BF16, 131072)
    skipped = SimConfig(kv_cache_dtype="fp8", num_layers=2, skip_layers=("0", "1"), kv_scale_error=0.30)
    assert await probability(skipped, 131072) == pytest.approx(0.91, abs=0.01)


def test_layer_accumulation_follows_gpu_image_and_skip_list() -> None:
    assert UNFIXED.layer_accumulation(0) is Accumulation.FP8_SINGLE_LEVEL
    assert FIXED.layer_accumulation(0) is Accumulation.FP8_TWO_LEVEL
    assert SimConfig(kv_cache_dtype="fp8", gpu=Gpu.H200).layer_accumulation(0) is Accumulation.FP8_SINGLE_LEVEL
    for gpu in (Gpu.B200, Gpu.A100, Gpu.L40S):
        assert SimConfig(kv_cache_dtype="fp8", gpu=gpu).layer_accumulation(0) is Accumulation.FP8_BLACKWELL
    skip = SimConfig(kv_cache_dtype="fp8", num_layers=6, sliding_window_layers=4, skip_layers=("sliding_window", "5"))
    # Two full-attention layers spread evenly over six: layers 2 and 5; layer 5 is skipped by index.
    assert [skip.is_sliding_window(layer) for layer in range(6)] == [True, True, False, True, True, False]
    expected = [Accumulation.BF16] * 6
    expected[2] = Accumulation.FP8_SINGLE_LEVEL
    assert [skip.layer_accumulation(layer) for layer in range(6)] == expected


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of"),
        ({"skip_layers": ("99",)}, "layer indices below 32"),
        ({"sliding_window_layers": 32}, "sliding_window_layers must be between"),
        ({"head_dim": 0}, "head_dim must be positive"),
        ({"kv_scale_error": 1.0}, r"kv_scale_error must be in \[0, 1\), got 1.0"),
        ({"kv_scale_error": -0.1}, "kv_scale_error must be in"),
    ],
)
def test_invalid_configurations_name_what_to_fix(overrides: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SimConfig(**overrides)


def test_latency_reproduces_the_published_h100_fits() -> None:
    bf16, fp8 = latency_fit(BF16), latency_fit(UNFIXED)
    assert (bf16.itl_slope_ms, bf16.itl_intercept_ms) == pytest.approx((4.37e-5, 6.44))
    assert (fp8.itl_slope_ms, fp8.itl_intercept_ms) == pytest.approx((2.37e-5, 6.58))
    break_even = (fp8.itl_intercept_ms - bf16.itl_intercept_ms) / (bf16.itl_slope_ms - fp8.itl_slope_ms)
    assert break_even == pytest.approx(7010, rel=0.01)


def test_skipping_sliding_window_layers_decodes_faster_than_full_fp8() -> None:
    """gpt-oss-20b on H100: slope 8.94e-6 (BF16) -> 7.14e-6 (full FP8) -> 6.34e-6 (sliding-window layers skipped)."""
    profile = {"head_dim": 64, "num_layers": 24, "sliding_window_layers": 12, "sliding_window_tokens": 128}
    bf16 = latency_fit(SimConfig(**profile))
    full = latency_fit(SimConfig(kv_cache_dtype="fp8", **profile))
    skip = latency_fit(SimConfig(kv_cache_dtype="fp8", skip_layers=("sliding_window",), **profile))
    assert bf16.itl_slope_ms > full.itl_slope_ms > skip.itl_slope_ms
    assert full.itl_slope_ms / skip.itl_slope_ms == pytest.approx(7.14 / 6.34)


def test_head_dim_256_two_level_pays_the_prefill_penalty_unless_the_image_has_the_fast_path() -> None:
    profile = {"head_dim": 256, "num_layers": 35, "sliding_window_layers": 28, "kv_cache_dtype": "fp8"}
    unfixed = latency_fit(SimConfig(**profile))
    fixed = latency_fit(SimConfig(two_level_fix=True, **profile))
    fast = latency_fit(SimConfig(two_level_fix=True, fast_head_dim_256=True, **profile))
    assert fixed.ttft_quad_ms / unfixed.ttft_quad_ms == pytest.approx(HEAD_DIM_256_TWO_LEVEL_PENALTY)
    assert fast.ttft_quad_ms == pytest.approx(unfixed.ttft_quad_ms)


def test_latency_multiplier_scales_every_term() -> None:
    slow = latency_fit(SimConfig(latency_multiplier=2.0))
    base = latency_fit(BF16)
    assert slow.itl_ms(50000) == pytest.approx(2 * base.itl_ms(50000))
    assert slow.ttft_ms(50000) == pytest.approx(2 * base.ttft_ms(50000))


def test_answers_are_deterministic_and_wrong_answers_are_distractors() -> None:
    needles = {"amber-river": ("1234567",), "calm-dune": ("7654321",)}
    right = answer_needles(needles, ("amber-river",), 1000, capability_p=1.0, survival_p=1.0, seed=0)
    wrong = answer_needles(needles, ("amber-river",), 1000, capability_p=1.0, survival_p=0.0, seed=0)
    assert right == " 1234567."
    assert wrong == " 7654321."
    assert answer_needles(needles, ("amber-river",), 1000, 0.5, 0.5, seed=3) == answer_needles(
        needles, ("amber-river",), 1000, 0.5, 0.5, seed=3
    )


def test_latency_samples_carry_noise_and_slow_down_with_concurrency() -> None:
    fit = latency_fit(BF16)
    alone = [sample_latencies(fit, 20000, 129, 1, np.random.default_rng(seed)) for seed in range(20)]
    loaded = [sample_latencies(fit, 20000, 129, 8, np.random.default_rng(seed)) for seed in range(20)]
    itl_alone = np.mean([np.mean(gaps) for _, gaps in alone])
    # Llama-3.1-8B on H100 at ~20k context: 15.18 ms median ITL at concurrency 8 against ~7.3 ms alone.
    assert itl_alone == pytest.approx(fit.itl_ms(20064), rel=0.02)
    assert np.mean([np.mean(gaps) for _, gaps in loaded]) / itl_alone == pytest.approx(15.18 / 7.3, rel=0.02)
    ttfts = [ttft for ttft, _ in alone]
    assert len(set(ttfts)) == 20 and np.std(ttfts) / np.mean(ttfts) < 0.05
    assert [len(gaps) for _, gaps in alone] == [128] * 20


def test_emulated_errors_are_shared_between_processes_through_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(accuracy.CACHE_DIR_ENV, str(tmp_path))
    computed = accuracy.emulated_error(Accumulation.FP8_SINGLE_LEVEL, 4096, 128)
    [cached] = tmp_path.iterdir()
    assert json.loads(cached.read_text()) == {"relative": computed}

    def no_emulator(*_: object) -> None:
        raise AssertionError("the emulator ran although a cached result exists")

    with monkeypatch.context() as patched:
        patched.setattr(accuracy, "attention_error", no_emulator)
        assert accuracy.emulated_error(Accumulation.FP8_SINGLE_LEVEL, 4096, 128) == computed
    cached.write_text("{truncated")
    assert accuracy.emulated_error(Accumulation.FP8_SINGLE_LEVEL, 4096, 128) == computed
    assert json.loads(cached.read_text()) == {"relative": computed}
