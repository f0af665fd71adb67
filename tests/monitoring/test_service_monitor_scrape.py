"""The chart's ServiceMonitor through a real Prometheus: the job the Prometheus Operator would generate from it scrapes
a process serving the operator's metrics registry, and the repository's alert rules run on what it stored.

The operator's series carry the KVPolicy's own `namespace` ("llm"); the scrape target's `namespace` is the operator's
("kvpolicy-system"). Without `honorLabels` (the Prometheus Operator's default, which the chart used to leave) the target
label wins: the policy's namespace becomes `exported_namespace` and every alert names kvpolicy-system. With
`honorLabels: true` (the chart now) the alerts name llm.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import yaml
from analysis.live_fleet import PROMETHEUS, SCRAPE_INTERVAL, PrometheusServer, ServerProcess, launch_process, wait_until
from chart.chart_helpers import CHART_DIR, REGISTRY, RELEASE, RELEASE_NAMESPACE, find_tool, run_tool
from prometheus_operator import endpoints_target, scrape_config

HERE = Path(__file__).parent
ALERTS = HERE.parents[1] / "monitoring" / "alerts.yaml"
POLICY_NAMESPACE = "llm"  # where tests/monitoring/operator_metrics_server.py's policies live
OPERATOR_POD = f"{RELEASE}-kvpolicy-operator-5d9c7b8f4-x2x7k"

pytestmark = pytest.mark.prometheus


@pytest.fixture(scope="module")
def chart_objects() -> tuple[dict[str, Any], dict[str, Any]]:
    """The ServiceMonitor and the metrics Service as the chart renders them."""
    helm = find_tool("helm")
    command = [
        helm,
        "template",
        RELEASE,
        CHART_DIR,
        "--namespace",
        RELEASE_NAMESPACE,
        "--set",
        f"serviceMonitor.enabled=true,imageRegistry={REGISTRY}",
    ]
    rendered = run_tool(command)
    assert rendered.returncode == 0, rendered.stderr
    documents = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    [monitor] = [d for d in documents if d["kind"] == "ServiceMonitor"]
    [service] = [d for d in documents if d["kind"] == "Service"]
    return monitor, service


@pytest.fixture(scope="module")
def operator_metrics() -> Iterator[ServerProcess]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed: `make prometheus` installs Debian's package")
    process = launch_process(OPERATOR_POD, [sys.executable, str(HERE / "operator_metrics_server.py")])
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def prometheus_for(monitor: dict[str, Any], service: dict[str, Any], operator: ServerProcess) -> PrometheusServer:
    """A Prometheus running the Prometheus Operator's job for `monitor` (every 200 ms) and the alert rules."""
    [port] = service["spec"]["ports"]
    target = endpoints_target(f"127.0.0.1:{operator.port}", service, OPERATOR_POD, "operator", port["name"])
    job = scrape_config(monitor, [target], SCRAPE_INTERVAL)
    return PrometheusServer([operator], rule_files=[ALERTS], scrape_configs=[job])


@pytest.fixture(scope="module")
def honoring(
    chart_objects: tuple[dict[str, Any], dict[str, Any]], operator_metrics: ServerProcess
) -> Iterator[PrometheusServer]:
    monitor, service = chart_objects
    server = prometheus_for(monitor, service, operator_metrics)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def overriding(
    chart_objects: tuple[dict[str, Any], dict[str, Any]], operator_metrics: ServerProcess
) -> Iterator[PrometheusServer]:
    """The same ServiceMonitor without honorLabels, as the chart rendered it before."""
    monitor, service = chart_objects
    without = copy.deepcopy(monitor)
    for endpoint in without["spec"]["endpoints"]:
        endpoint.pop("honorLabels", None)
    server = prometheus_for(without, service, operator_metrics)
    yield server
    server.stop()


def firing(server: PrometheusServer) -> dict[str, dict[str, str]]:
    """alertname -> labels of the alerts that fire (the ones without `for`), once they do."""
    wanted = {"KVPolicyRolledBack", "KVPolicyAccuracyRecoveryLow"}

    def alerts() -> dict[str, dict[str, str]]:
        with urlopen(f"{server.url}/api/v1/alerts", timeout=5) as response:
            found = json.load(response)["data"]["alerts"]
        return {a["labels"]["alertname"]: a["labels"] for a in found if a["state"] == "firing"}

    wait_until(lambda: wanted <= alerts().keys(), 30, f"{wanted} to fire")
    return alerts()


def test_the_chart_keeps_the_policys_namespace(honoring: PrometheusServer, chart_objects: Any) -> None:
    _, service = chart_objects
    [series] = honoring.query('kvpolicy_gate_recovery_ratio{policy="lossy"}')
    labels = series["metric"]
    assert labels["namespace"] == POLICY_NAMESPACE
    assert "exported_namespace" not in labels
    # The target labels the Prometheus Operator adds are still there.
    assert (labels["job"], labels["service"], labels["pod"], labels["endpoint"], labels["container"]) == (
        service["metadata"]["name"],
        service["metadata"]["name"],
        OPERATOR_POD,
        "metrics",
        "operator",
    )
    # A series the operator exports without a namespace keeps the target's: where the operator runs.
    [build] = honoring.query("kvpolicy_build_info")
    assert build["metric"]["namespace"] == RELEASE_NAMESPACE


def test_alerts_name_the_policys_namespace_with_honor_labels(honoring: PrometheusServer) -> None:
    alerts = firing(honoring)
    # "lossy" rolled back; "unrolled" measured as low but did not roll back (operator_metrics_server.py).
    for name, policy in (("KVPolicyRolledBack", "lossy"), ("KVPolicyAccuracyRecoveryLow", "unrolled")):
        assert (alerts[name]["namespace"], alerts[name]["policy"]) == (POLICY_NAMESPACE, policy), alerts[name]


def test_without_honor_labels_the_namespace_is_renamed_and_alerts_point_at_the_operator(
    overriding: PrometheusServer,
) -> None:
    [series] = overriding.query('kvpolicy_gate_recovery_ratio{policy="lossy"}')
    assert series["metric"]["namespace"] == RELEASE_NAMESPACE
    assert series["metric"]["exported_namespace"] == POLICY_NAMESPACE
    alerts = firing(overriding)
    for name in ("KVPolicyRolledBack", "KVPolicyAccuracyRecoveryLow"):
        assert alerts[name]["namespace"] == RELEASE_NAMESPACE, alerts[name]  # the wrong namespace
