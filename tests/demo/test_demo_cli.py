from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from kvpolicy_dev.demo import cli, run
from kvpolicy_dev.demo.scenarios import DEMO_TIMING, FAST_TIMING, SCENARIOS, VLLM_TIMING

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


def test_real_vllm_servers_run_the_same_scenarios_two_at_a_time() -> None:
    assert run.waves(run.Servers.SIMULATOR) == [SCENARIOS]
    real = run.waves(run.Servers.VLLM)
    assert [len(wave) for wave in real] == [2, 2, 2] and tuple(s for wave in real for s in wave) == SCENARIOS


def test_fast_mode_is_for_the_simulator_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--servers", "vllm", "--fast"])
    assert exit_info.value.code == 2
    assert "--fast is for the simulator" in capsys.readouterr().err
