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
    """Policy "first" decided once at 30m (its counter series is born at 1), "again" had decided before the range
    and decided again at 50m (1 -> 2), "old" decided only before the range: in the last hour (to 70m) the panel
    shows one decision each for "first" and "again", and none for "old"."""
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


def test_the_dashboard_has_what_a_rollout_needs() -> None:
    """Issue 23 item 10: each policy's state, operator health, vLLM's own series per side (requests, KV cache usage,
    latency), the canary's traffic share, and decisions and phase changes as annotations."""
    by_title = panels()
    queries = {title: " ".join(t["expr"] for t in panel.get("targets", [])) for title, panel in by_title.items()}
    assert "kvpolicy_policy_info" in queries["Policies"] and by_title["Policies"]["type"] == "table"
    for metric in ("kvpolicy_leader", "kvpolicy_api_reachable", "kvpolicy_operator_restarts_total"):
        assert metric in queries["Operator health"]
    per_side = ["Requests finished per second", "Traffic share of the canary", "KV cache usage"]
    per_side += ["TTFT p95 per side (vLLM histograms)", "ITL p95 per side (vLLM histograms)"]
    for title in per_side:
        assert "kvpolicy_rollout_pod_info" in queries[title] and "vllm[:_]" in queries[title], title
    assert "(kv|gpu)_cache_usage_perc" in queries["KV cache usage"]
    annotations = json.loads((MONITORING / "dashboard.json").read_text())["annotations"]["list"]
    assert {
        a["name"]: ("kvpolicy_decisions_total" in a["expr"], "kvpolicy_policy_info" in a["expr"]) for a in annotations
    } == {
        "Decisions": (True, False),
        "Phase changes": (False, True),
    }


def test_the_traffic_share_panel_is_the_canarys_share_of_both_sides_requests(tmp_path: Path) -> None:
    """One canary pod finishing 1 request/s beside three target pods at 1 request/s each: a share of 0.25. Pods of
    another policy, and vLLM pods of no rollout, do not count. The vLLM series are spelled both ways (`vllm:` from a
    text-format scrape, `vllm_` from an OpenMetrics one)."""
    [target] = panels()["Traffic share of the canary"]["targets"]
    expr = as_grafana_runs(target["expr"], "1h")
    pods = {"llama-fp8-canary-g1-x": "canary", "llama-a": "baseline", "llama-b": "baseline", "llama-c": "baseline"}
    series = [
        {
            "series": f'kvpolicy_rollout_pod_info{{namespace="llm",policy="llama-fp8",role="{role}",pod="{pod}"}}',
            "values": "1x20",
        }
        for pod, role in pods.items()
    ]
    for index, pod in enumerate([*pods, "other-model-z"]):
        name = "vllm:request_success_total" if index % 2 else "vllm_request_success_total"
        series.append(
            {"series": f'{{__name__="{name}",namespace="llm",pod="{pod}",finished_reason="stop"}}', "values": "0+60x20"}
        )
    expected = [{"labels": '{namespace="llm",policy="llama-fp8"}', "value": 0.25}]
    assert promtool_test(tmp_path, series, [{"expr": expr, "eval_time": "10m", "exp_samples": expected}]) == ""
