"""The chart's PodMonitor for the canaries through a real Prometheus (issue 23 item 3): the job the Prometheus Operator
generates from it scrapes a canary pod (a `kvpolicy sim` serving FP8, labelled as the operator labels a canary's pods
before the accuracy gate), and the served-configuration check reads that canary's vllm:cache_config_info through
Prometheus. A monitor of the target's pods, which is all a cluster had before, never selects that pod: Prometheus has
nothing of it, and the check reads the canary's own /metrics instead of waiting for its progress deadline and rolling
back. Gate Job pods are not scraped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from analysis.live_fleet import PROMETHEUS, SCRAPE_INTERVAL, PrometheusServer, ServerProcess, launch_simulator
from chart.chart_helpers import CHART_DIR, REGISTRY, RELEASE, RELEASE_NAMESPACE, find_tool, run_tool
from kvpolicy.analysis.model import SideSelector
from kvpolicy.analysis.prometheus import PrometheusProvider
from kvpolicy.rollout import builders as b
from prometheus_operator import pod_monitor_scrape_config, pod_target

pytestmark = pytest.mark.prometheus

NAMESPACE = "llm"
PORT = "http"
CANARY_POD = "llama-fp8-canary-g1-5d9c7b8f4-x2x7k"
GATE_POD = "llama-fp8-accuracy-g1-abcde"
TARGET_POD = "llama-7c9d8b6f5-fghij"
TARGET_LABELS = {"app": "llama"}
# What the operator's builders give a canary's pods before the accuracy gate, and a gate Job's.
CANARY_LABELS = {**b.policy_labels("llama-fp8"), b.ROLE_LABEL: b.ROLE_CANARY, b.MANAGED_BY_LABEL: b.MANAGED_BY}
GATE_LABELS = {**b.policy_labels("llama-fp8"), b.ROLE_LABEL: b.ROLE_GATE, b.MANAGED_BY_LABEL: b.MANAGED_BY}


def rendered_pod_monitor() -> dict[str, Any]:
    command = [find_tool("helm"), "template", RELEASE, CHART_DIR, "--namespace", RELEASE_NAMESPACE]
    command += ["--set", f"podMonitor.enabled=true,podMonitor.port={PORT},imageRegistry={REGISTRY}"]
    rendered = run_tool(command)
    assert rendered.returncode == 0, rendered.stderr
    [monitor] = [d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "PodMonitor"]
    return monitor


def users_pod_monitor() -> dict[str, Any]:
    """A PodMonitor for the target's pods, as a team serving vLLM writes one (selecting its Deployment's labels)."""
    endpoint = {"port": PORT, "path": "/metrics"}
    spec = {"selector": {"matchLabels": TARGET_LABELS}, "podMetricsEndpoints": [endpoint]}
    return {"metadata": {"namespace": NAMESPACE, "name": "llama"}, "spec": spec}


@pytest.fixture(scope="module")
def pods() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed: `make prometheus` installs Debian's package")
    canary, gate = launch_simulator(CANARY_POD), launch_simulator(GATE_POD)
    try:
        yield canary.wait_ready(), gate.wait_ready()
    finally:
        canary.stop()
        gate.stop()


def prometheus_for(monitor: dict[str, Any], pods: tuple[ServerProcess, ServerProcess]) -> PrometheusServer:
    canary, gate = pods
    targets = [
        pod_target(f"127.0.0.1:{canary.port}", NAMESPACE, CANARY_POD, "vllm", PORT, CANARY_LABELS),
        pod_target(f"127.0.0.1:{gate.port}", NAMESPACE, GATE_POD, "gate", PORT, GATE_LABELS),
    ]
    job = pod_monitor_scrape_config(monitor, targets, SCRAPE_INTERVAL)
    # PrometheusServer waits for `up == 1` of as many targets as it is given: the one the relabelling keeps.
    return PrometheusServer([canary], scrape_configs=[job])


async def served(server: PrometheusServer, *endpoints: str) -> Any:
    """The served-configuration reading of the canary's side, as the operator selects it (its pods' names and URLs)."""
    provider = PrometheusProvider(server.url)
    try:
        return await provider.served(SideSelector("canary", NAMESPACE, pods=(CANARY_POD,), endpoints=endpoints))
    finally:
        await provider.close()


async def test_the_chart_pod_monitor_lets_the_served_check_read_the_canary(
    pods: tuple[ServerProcess, ServerProcess],
) -> None:
    server = prometheus_for(rendered_pod_monitor(), pods)
    try:
        reading = await served(server)
        assert reading.missing is None, reading.missing
        [config] = reading.configs
        assert config.kv_cache_dtype == "fp8"
        [up] = server.query("up")
        labels = up["metric"]
        assert (labels["namespace"], labels["pod"], labels["container"], labels["endpoint"]) == (
            NAMESPACE,
            CANARY_POD,
            "vllm",
            PORT,
        )
        assert (labels["kvpolicy_policy"], labels["kvpolicy_role"]) == ("llama-fp8", "canary")
        assert not server.query(f'up{{pod="{GATE_POD}"}}'), "gate Job pods are not scraped"
    finally:
        server.stop()


async def test_a_monitor_of_the_target_alone_never_sees_the_canary(pods: tuple[ServerProcess, ServerProcess]) -> None:
    """The target's pod is scraped (it carries the labels the team's monitor selects); the canary's is not."""
    canary, _ = pods
    target = launch_simulator(TARGET_POD).wait_ready()
    targets = [
        pod_target(f"127.0.0.1:{canary.port}", NAMESPACE, CANARY_POD, "vllm", PORT, CANARY_LABELS),
        pod_target(f"127.0.0.1:{target.port}", NAMESPACE, TARGET_POD, "vllm", PORT, TARGET_LABELS),
    ]
    job = pod_monitor_scrape_config(users_pod_monitor(), targets, SCRAPE_INTERVAL)
    server = PrometheusServer([target], scrape_configs=[job])
    try:
        reading = await served(server)
        assert reading.configs == () and reading.missing is not None
        assert "has no vllm:cache_config_info of the canary" in reading.missing
        assert [up["metric"]["pod"] for up in server.query("up")] == [TARGET_POD]
        # The operator knows the canary's pods' URLs: it reads what they serve from their own /metrics.
        direct = await served(server, canary.url)
        assert direct.missing is None and [config.kv_cache_dtype for config in direct.configs] == ["fp8"]
        # A pod that cannot be read either: both are said, and the check keeps waiting (no verdict from nothing).
        gone = await served(server, "http://127.0.0.1:9")
        assert gone.configs == () and gone.missing is not None
        assert gone.missing.startswith("Prometheus at ") and "its pods' /metrics could not be read" in gone.missing
    finally:
        server.stop()
        target.stop()
