"""The alert rules and the dashboard against a real Prometheus scraping a process that serves the operator's metrics:
the rules load and fire on the operator's real metric names, and every dashboard query is valid and has data."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import yaml
from analysis.live_fleet import (
    PROMETHEUS,
    PrometheusServer,
    ServerProcess,
    launch_fake_vllm,
    launch_process,
    wait_until,
)
from operator_metrics_server import BASELINE_POD, CANARY_POD

HERE = Path(__file__).parent
MONITORING = HERE.parents[1] / "monitoring"

pytestmark = pytest.mark.prometheus


def job(target: ServerProcess, namespace: str, honor_labels: bool = False) -> dict[str, Any]:
    labels = {"namespace": namespace, "pod": target.pod}
    address = f"127.0.0.1:{target.port}"
    return {
        "job_name": target.pod,
        "honor_labels": honor_labels,
        "static_configs": [{"targets": [address], "labels": labels}],
    }


@pytest.fixture(scope="module")
def prometheus() -> Iterator[PrometheusServer]:
    """The operator's metrics (honouring their labels, as the chart's ServiceMonitor does) and two vLLM stand-ins
    for the canary's and the baseline's pods of policy "slow", as a pod scrape labels them."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed: `make prometheus` installs Debian's package")
    operator = launch_process("kvpolicy-operator", [sys.executable, str(HERE / "operator_metrics_server.py")])
    pods = [launch_fake_vllm(CANARY_POD), launch_fake_vllm(BASELINE_POD)]
    processes = [operator, *pods]
    try:
        for process in processes:
            process.wait_ready()
        jobs = [job(operator, "kvpolicy-system", honor_labels=True), *(job(pod, "llm") for pod in pods)]
        server = PrometheusServer(processes, rule_files=[MONITORING / "alerts.yaml"], scrape_configs=jobs)
    except BaseException:
        for process in processes:
            process.stop()
        raise
    try:
        yield server
    finally:
        server.stop()
        for process in processes:
            process.stop()


def get(server: PrometheusServer, path: str) -> Any:
    with urlopen(f"{server.url}{path}", timeout=5) as response:
        return json.load(response)["data"]


def test_rules_load_and_evaluate(prometheus: PrometheusServer) -> None:
    def evaluated() -> list[dict[str, Any]]:
        return [rule for group in get(prometheus, "/api/v1/rules")["groups"] for rule in group["rules"]]

    wait_until(lambda: all(rule.get("lastEvaluation", "").startswith("2") for rule in evaluated()), 30, "rules")
    rules = evaluated()
    assert len(rules) == len(yaml.safe_load((MONITORING / "alerts.yaml").read_text())["groups"][0]["rules"])
    assert {rule["name"]: rule["health"] for rule in rules} == dict.fromkeys({rule["name"] for rule in rules}, "ok")


def test_alerts_fire_on_the_operator_metrics(prometheus: PrometheusServer) -> None:
    def states() -> dict[tuple[str, str], str]:
        alerts = get(prometheus, "/api/v1/alerts")["alerts"]
        return {(alert["labels"]["alertname"], alert["labels"].get("policy", "")): alert["state"] for alert in alerts}

    expected = {
        ("KVPolicyRolledBack", "lossy"): {"firing"},
        ("KVPolicyAccuracyRecoveryLow", "unrolled"): {"firing"},  # not "lossy": it rolled back
        # These wait out their `for` clause (2 and 5 minutes; promtool's tests check the timing).
        ("KVPolicyCanaryTTFTRegression", "slow"): {"pending", "firing"},
        ("KVPolicyRolloutStuck", "stuck"): {"pending", "firing"},
        ("KVPolicyOperatorCannotReachAPI", ""): {"pending", "firing"},
        ("KVPolicyOperatorNotActing", ""): {"pending", "firing"},
        ("KVPolicyCanaryTrafficSkewed", "skewed"): {"pending", "firing"},
    }

    def as_expected() -> bool:
        current = states()
        return current.keys() == expected.keys() and all(current[key] in expected[key] for key in current)

    wait_until(as_expected, 30, f"alerts {expected}")


def dashboard_queries() -> list[tuple[str, str]]:
    """Every panel's query and every annotation's."""
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    panels = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]
    return panels + [(annotation["name"], annotation["expr"]) for annotation in dashboard["annotations"]["list"]]


def test_dashboard_queries_are_valid_and_have_data(prometheus: PrometheusServer) -> None:
    substitutions = {"$namespace": ".*", "$policy": ".*", "$__range": "1h", "$__rate_interval": "1m"}
    # The canary-vs-baseline panels join vLLM's series to kvpolicy_rollout_pod_info: a side each, for "slow".
    [requests] = [expr for title, expr in dashboard_queries() if title == "Requests finished per second"]
    for variable, value in substitutions.items():
        requests = requests.replace(variable, value)

    def sides() -> set[tuple[str, str, str]]:
        return {
            (s["metric"]["namespace"], s["metric"]["policy"], s["metric"]["role"]) for s in prometheus.query(requests)
        }

    expected = {("llm", "slow", "canary"), ("llm", "slow", "baseline")}
    wait_until(lambda: sides() == expected, 10, f"{expected}: {sides()}")
    for title, expr in dashboard_queries():
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"{title}: unknown variable in {expr}"
        prometheus.query(expr)  # raises on invalid PromQL (HTTP 400)
        # Rates need two scrapes of the operator: a query may be empty for a moment after Prometheus started.
        wait_until(lambda query=expr: bool(prometheus.query(query)), 10, f"{title}: data for {expr}")
