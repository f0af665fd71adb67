"""The dashboard's queries evaluated by promtool on series shaped as the operator exports them (the live test in
test_monitoring_live.py checks they are valid and have data; this checks they count right)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed: `make prometheus` installs it")


def panels() -> dict[str, dict[str, Any]]:
    return {panel["title"]: panel for panel in json.loads((MONITORING / "dashboard.json").read_text())["panels"]}


def as_grafana_runs(expr: str, range_: str) -> str:
    """The query with the dashboard's variables as Grafana fills them: every namespace and policy, the time range."""
    for variable, value in {"$namespace": ".*", "$policy": ".*", "$__range": range_, "$__rate_interval": "1m"}.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def promtool_test(tmp_path: Path, input_series: list[dict[str, str]], expr_tests: list[dict[str, Any]]) -> str:
    """Run promtool's unit tests for PromQL expressions; its output when they fail, else ''."""
    assert PROMTOOL is not None
    (tmp_path / "rules.yaml").write_text("groups: []\n")
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series, "promql_expr_test": expr_tests}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    return "" if result.returncode == 0 else result.stdout + result.stderr


def test_the_decisions_panel_counts_each_policys_first_decision(tmp_path: Path) -> None:
    """The policy "first" decided once at 30m (its counter series is born at 1), "again" had decided before the range and
    decided again at 50m (1 -> 2), "old" decided only before the range: in the last hour (to 70m) the panel shows
    one decision each for "first" and "again", and none for "old"."""
    [target] = panels()["Decisions"]["targets"]
    expr = as_grafana_runs(target["expr"], "1h")
    decision = 'kvpolicy_decisions_total{{namespace="llm",policy="{}",result="{}",reason="{}",pod="op-1"}}'
    series = [
        {"series": decision.format("first", "RolledBack", "TTFTRatioExceeded"), "values": "_x30 1x40"},
        {"series": decision.format("again", "Promoted", "GatesPassed"), "values": "1x50 2x20"},
        {"series": decision.format("old", "Promoted", "GatesPassed"), "values": "1x70"},
    ]
    labels = 'namespace="llm",policy="{}",result="{}",reason="{}"'
    expected = [
        {"labels": "{" + labels.format("first", "RolledBack", "TTFTRatioExceeded") + "}", "value": 1},
        {"labels": "{" + labels.format("again", "Promoted", "GatesPassed") + "}", "value": 1},
        {"labels": "{" + labels.format("old", "Promoted", "GatesPassed") + "}", "value": 0},
    ]
    assert promtool_test(tmp_path, series, [{"expr": expr, "eval_time": "70m", "exp_samples": expected}]) == ""
