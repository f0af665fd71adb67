"""The demo's failure paths, run in-process: they must fail loudly, report honestly and leave nothing running."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
import yaml
from demo_helpers import processes_mentioning
from kvpolicy_dev.demo import run as demo_run
from kvpolicy_dev.demo import scenarios
from kvpolicy_dev.demo.processes import ChildExitedError
from kvpolicy_dev.demo.run import DemoError, DemoOptions, all_decided, in_scenario_order, log_records_to, run_demo


def _options(report_dir: Path, deadline_seconds: float = 120.0) -> DemoOptions:
    return DemoOptions(
        report_dir=report_dir,
        timing=scenarios.FAST_TIMING,
        mode="test",
        use_prometheus=False,
        deadline_seconds=deadline_seconds,
        requests_per_second=1.0,
    )


@pytest.fixture
def no_figures_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # The figures take CPU-seconds; these tests are about what happens around them.
    monkeypatch.setattr(demo_run, "FIGURES_WAIT_SECONDS", 0.1)


async def test_without_the_operator_nothing_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(demo_run, "operator_available", lambda: False)
    with pytest.raises(DemoError, match=r"operator .* is not part of this install.*nothing was started"):
        await run_demo(_options(tmp_path / "report"), io.StringIO(), live=False)
    assert not (tmp_path / "report").exists()


async def test_an_operator_that_dies_stops_the_demo_with_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_figures_wait: None
) -> None:
    crash = [sys.executable, "-c", "import sys; print('cannot reach the API server'); sys.exit(3)"]
    monkeypatch.setattr(demo_run, "operator_argv", lambda: crash)
    report_dir = tmp_path / "report"
    with pytest.raises(ChildExitedError, match=r"operator exited with code 3(.|\n)*cannot reach the API server"):
        await run_demo(_options(report_dir), io.StringIO(), live=False)
    assert processes_mentioning(str(report_dir)) == []


def _a_child_still_drawing(report_dir: Path) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(60)", str(report_dir)]


async def test_undecided_policies_are_reported_as_they_stand(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_figures_wait: None
) -> None:
    # Figures that are still being drawn when the demo ends are reported as not drawn (and their child is stopped).
    monkeypatch.setattr(demo_run, "figures_argv", _a_child_still_drawing)
    report_dir = tmp_path / "report"
    out = io.StringIO()
    result = await run_demo(_options(report_dir, deadline_seconds=0.1), out, live=False)
    assert not result.decided
    assert "not every policy was decided within 0 s" in out.getvalue()
    saved = list(yaml.safe_load_all((report_dir / "kvpolicies.yaml").read_text()))
    assert len(saved) == len(scenarios.SCENARIOS)
    # Whatever the operator had written by then is shown, and nothing claims a decision it did not make.
    report = result.report.read_text()
    for obj in saved:
        decision = (obj.get("status") or {}).get("decision")
        assert decision is None or decision["result"] in report
    assert "figures could not be drawn" in report
    assert processes_mentioning(str(report_dir)) == []


async def test_a_prometheus_that_cannot_start_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_figures_wait: None
) -> None:
    broken = tmp_path / "prometheus"
    broken.write_text("#!/bin/sh\necho 'err: bind: address already in use' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(demo_run, "find_prometheus", lambda: str(broken))
    options = DemoOptions(**{**_options(tmp_path / "report").__dict__, "use_prometheus": True})
    with pytest.raises(DemoError, match=r"Prometheus \(.*\) did not start(.|\n)*address already in use"):
        await run_demo(options, io.StringIO(), live=False)
    assert processes_mentioning(str(tmp_path / "report")) == []


def test_all_decided_needs_a_terminal_phase_and_a_decision() -> None:
    decision = {"result": "Promoted", "reason": "GatesPassed"}
    assert all_decided([{"status": {"phase": "Promoted", "decision": decision}}])
    assert not all_decided([{"status": {"phase": "Promoting", "decision": decision}}])
    assert not all_decided([{"status": {"phase": "Promoted"}}])
    assert not all_decided([])


def test_policies_follow_the_scenario_order() -> None:
    names = ["zzz-extra", "gpt-oss-20b", "llama-longdoc-unfixed", "aaa-extra"]
    ordered = in_scenario_order([{"metadata": {"name": name}} for name in names])
    assert [obj["metadata"]["name"] for obj in ordered] == [
        "llama-longdoc-unfixed",
        "gpt-oss-20b",
        "aaa-extra",
        "zzz-extra",
    ]


def test_log_records_go_to_the_file_while_the_demo_runs(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    handlers = list(logging.getLogger().handlers)
    with log_records_to(log):
        logging.getLogger("kvpolicy_dev.devcluster.kubelet").warning("pod exited with 1")
    assert "WARNING kvpolicy_dev.devcluster.kubelet: pod exited with 1" in log.read_text()
    assert logging.getLogger().handlers == handlers
