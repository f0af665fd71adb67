"""The model catalogue: the profile a `vllm serve` command line gets, and the published fits each profile reproduces."""

import pytest
from kvpolicy_dev.sim.cli import build_parser, config_from_args, describe
from kvpolicy_dev.sim.config import Gpu, SimConfig
from kvpolicy_dev.sim.latency import GPU_LATENCY, HEAD_DIM_256_TWO_LEVEL_PENALTY, latency_fit
from kvpolicy_dev.sim.models import DEFAULT_PROFILE
from kvpolicy_dev.sim.server import kv_cache_capacity_tokens


def config(*argv: str) -> SimConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def break_even(bf16: SimConfig, fp8: SimConfig) -> float:
    base, fast = latency_fit(bf16), latency_fit(fp8)
    return (fast.itl_intercept_ms - base.itl_intercept_ms) / (base.itl_slope_ms - fast.itl_slope_ms)


@pytest.mark.parametrize(
    ("model", "profile", "shape"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", (128, 32, 0)),
        ("meta-llama/Llama-3.1-8B", "llama-3.1-8b", (128, 32, 0)),
        ("openai/gpt-oss-20b", "gpt-oss-20b", (64, 24, 12)),
        ("OPENAI/GPT-OSS-20B", "gpt-oss-20b", (64, 24, 12)),
        ("google/gemma-4-E2B-it", "gemma-e2b", (256, 30, 24)),
        ("google/gemma-3n-E2B", "gemma-e2b", (256, 30, 24)),
        ("Qwen/Qwen3-8B", "qwen3-8b", (128, 36, 0)),
        ("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-v2-lite", (576, 27, 0)),
        ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-v2-lite", (576, 27, 0)),
    ],
)
def test_the_model_name_picks_its_catalogue_profile(model: str, profile: str, shape: tuple[int, int, int]) -> None:
    chosen = config(model)
    assert chosen.profile.name == profile
    assert (chosen.head_dim, chosen.num_layers, chosen.sliding_window_layers) == shape
    assert f"model profile {profile} " in describe(chosen)


def test_sliding_window_sizes_and_mla_come_with_the_profile() -> None:
    assert config("openai/gpt-oss-20b").layer_context(0, 65536) == 128
    assert config("google/gemma-4-E2B-it").layer_context(0, 65536) == 512
    deepseek = config("deepseek-ai/DeepSeek-V2-Lite-Chat")
    assert deepseek.profile.mla and ", MLA)" in describe(deepseek)
    # One 576-wide latent per layer and token, in BF16: 27 x 576 x 2 bytes against Llama's 32 x 2 x 8 x 128 x 2.
    llama = config("meta-llama/Llama-3.1-8B-Instruct")
    ratio = kv_cache_capacity_tokens(deepseek) / kv_cache_capacity_tokens(llama)
    assert ratio == pytest.approx((32 * 2 * 8 * 128) / (27 * 576), rel=1e-3)


@pytest.mark.parametrize(
    "model", ["my/model", "meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen3-80B", "google/gemma-2b"]
)
def test_unknown_names_fall_back_to_the_default_profile_and_say_so(model: str) -> None:
    fallback = config(model)
    assert fallback.profile is DEFAULT_PROFILE
    assert (fallback.head_dim, fallback.num_layers, fallback.sliding_window_layers) == (128, 32, 0)
    assert "model profile default (Llama-3.1-8B-like)" in describe(fallback)
    assert latency_fit(fallback) == latency_fit(SimConfig())


def test_served_model_name_picks_the_profile_when_model_does_not() -> None:
    assert config("--served-model-name", "openai/gpt-oss-20b").profile.name == "gpt-oss-20b"
    assert config("/models/checkpoint", "--served-model-name", "Qwen/Qwen3-8B").profile.name == "qwen3-8b"
    # The positional MODEL, the checkpoint actually loaded, wins over an alias that names another model.
    both = config("openai/gpt-oss-20b", "--served-model-name", "Qwen/Qwen3-8B")
    assert (both.profile.name, both.served_model_name) == ("gpt-oss-20b", "Qwen/Qwen3-8B")
    nothing = config()
    assert nothing.served_model_name == SimConfig.served_model_name and nothing.profile.name == "llama-3.1-8b"


def test_explicit_shape_flags_win_field_by_field_and_the_published_fit_still_applies() -> None:
    override = config("openai/gpt-oss-20b", "--head-dim", "128", "--sliding-window-layers", "0")
    assert (override.head_dim, override.num_layers, override.sliding_window_layers) == (128, 24, 0)
    assert override.profile.name == "gpt-oss-20b"
    assert "head_dim 128, 24 layers)" in describe(override)
    # Doubling head_dim and making all 24 layers full attention quadruples the width the decode slope scales with.
    assert latency_fit(override).itl_slope_ms == pytest.approx(
        4 * latency_fit(config("openai/gpt-oss-20b")).itl_slope_ms
    )
    window = config("openai/gpt-oss-20b", "--sliding-window-tokens", "4096", "--num-layers", "36")
    assert (window.sliding_window_tokens, window.num_layers, window.sliding_window_layers) == (4096, 36, 12)


def test_gpt_oss_reproduces_its_h100_fits_with_and_without_skipping_sliding_window_layers() -> None:
    """vLLM blog, gpt-oss-20b, H100: ITL slope 8.94e-6 (BF16) -> 7.14e-6 (FP8) / 6.34e-6 (skip SW), break-even 7659."""
    bf16 = config("openai/gpt-oss-20b", "--gpu", "h100")
    full = config("openai/gpt-oss-20b", "--gpu", "h100", "--kv-cache-dtype", "fp8")
    skip = config(
        *("openai/gpt-oss-20b", "--gpu", "h100", "--kv-cache-dtype", "fp8"),
        *("--kv-cache-dtype-skip-layers", "sliding_window"),
    )
    slopes = [latency_fit(c).itl_slope_ms for c in (bf16, full, skip)]
    assert slopes == pytest.approx([8.94e-6, 7.14e-6, 6.34e-6])
    assert break_even(bf16, skip) == pytest.approx(7659)
    # Without the catalogue (the default profile with gpt-oss's shape) the width model gives other slopes.
    shape_only = config(
        *("my/model", "--gpu", "h100", "--head-dim", "64", "--num-layers", "24"),
        *("--sliding-window-layers", "12", "--sliding-window-tokens", "128"),
    )
    assert latency_fit(shape_only).itl_slope_ms != pytest.approx(8.94e-6, rel=0.05)


def test_gpt_oss_uses_its_own_b200_fit() -> None:
    """vLLM blog, gpt-oss-20b on B200: 3.56e-6 -> 2.06e-6, break-even ~13k."""
    bf16 = config("openai/gpt-oss-20b", "--gpu", "b200")
    fp8 = config("openai/gpt-oss-20b", "--gpu", "b200", "--kv-cache-dtype", "fp8")
    assert (latency_fit(bf16).itl_slope_ms, latency_fit(fp8).itl_slope_ms) == pytest.approx((3.56e-6, 2.06e-6))
    assert break_even(bf16, fp8) == pytest.approx(13000)


def test_gemma_reproduces_its_h100_itl_and_ttft_fits() -> None:
    """vLLM blog, gemma-4-E2B on H100: ITL slope 5.30e-5 -> 3.60e-5; TTFT quadratic 6.93e-7 -> 1.12e-6 (two-level)."""
    base = ("google/gemma-4-E2B-it", "--gpu", "h100")
    bf16, unfixed = config(*base), config(*base, "--kv-cache-dtype", "fp8")
    fixed = config(*base, "--kv-cache-dtype", "fp8", "--two-level-fix")
    assert (latency_fit(bf16).itl_slope_ms, latency_fit(unfixed).itl_slope_ms) == pytest.approx((5.30e-5, 3.60e-5))
    assert (latency_fit(unfixed).ttft_quad_ms, latency_fit(fixed).ttft_quad_ms) == pytest.approx((6.93e-7, 1.12e-6))
    fast = config(*base, "--kv-cache-dtype", "fp8", "--two-level-fix", "--fast-head-dim-256")
    assert latency_fit(fast).ttft_quad_ms == pytest.approx(6.93e-7)


@pytest.mark.parametrize(
    ("model", "dtype"),
    [("openai/gpt-oss-20b", "auto"), ("openai/gpt-oss-20b", "fp8"), ("google/gemma-4-E2B-it", "fp8")],
)
def test_an_h100_fit_carries_to_the_h200_as_the_gpu_tables_relate_them(model: str, dtype: str) -> None:
    h100 = latency_fit(config(model, "--gpu", "h100", "--kv-cache-dtype", dtype))
    h200 = latency_fit(config(model, "--gpu", "h200", "--kv-cache-dtype", dtype))
    bandwidth = GPU_LATENCY[Gpu.H200].itl_slope_ms / GPU_LATENCY[Gpu.H100].itl_slope_ms
    assert h200.itl_slope_ms / h100.itl_slope_ms == pytest.approx(bandwidth)
    assert h200.ttft_quad_ms == pytest.approx(h100.ttft_quad_ms)


def test_profiles_without_published_fits_follow_the_width_model() -> None:
    llama = latency_fit(config("meta-llama/Llama-3.1-8B-Instruct", "--gpu", "h100"))
    qwen = latency_fit(config("Qwen/Qwen3-8B", "--gpu", "h100"))
    assert llama.itl_slope_ms == pytest.approx(4.37e-5)
    assert qwen.itl_slope_ms == pytest.approx(4.37e-5 * 36 / 32)
    # MLA: FlashMLA has no head_dim-256 two-level path, so head_dim 576 pays no prefill penalty for the fix.
    deepseek = ("deepseek-ai/DeepSeek-V2-Lite-Chat", "--gpu", "h100", "--kv-cache-dtype", "fp8")
    unfixed, fixed = latency_fit(config(*deepseek)), latency_fit(config(*deepseek, "--two-level-fix"))
    assert fixed.ttft_quad_ms == pytest.approx(unfixed.ttft_quad_ms)
    gqa_576 = ("my/model", "--gpu", "h100", "--kv-cache-dtype", "fp8", "--head-dim", "576", "--two-level-fix")
    assert latency_fit(config(*gqa_576)).ttft_quad_ms / latency_fit(config(*gqa_576[:-1])).ttft_quad_ms == (
        pytest.approx(HEAD_DIM_256_TWO_LEVEL_PENALTY)
    )
