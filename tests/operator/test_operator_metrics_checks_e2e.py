"""Metrics checks deciding ReplicaRatio rollouts on the emulated cluster, the operator running under kopf in-process:
custom PromQL checks read through a real Prometheus (Debian's binary) scraping the simulator pods, and a check
registered in the metrics-check table by this test alone, with no change to the controller."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import PATCHED_IMAGE, OperatorFactory, container, event_reasons, policy, target, users, wait_decided
from kvpolicy.analysis.checks import MetricsCheck, Sides, Stage
from kvpolicy.analysis.model import SideMetrics, Verdict
from kvpolicy.analysis.provider import MetricsProvider
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.api.v1alpha1 import GateVerdict, KVPolicy
from kvpolicy.rollout import metric_checks
from kvpolicy_dev.demo.prometheus import LocalPrometheus, find_prometheus
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster

Obj = dict[str, Any]
# The quick live analysis of test_operator_latency_e2e, with TTFT/ITL thresholds no canary breaches.
LATENCY = {
    "enabled": True,
    "ttftMaxRatio": "100",
    "itlMaxRatio": "100",
    "windowSeconds": 10,
    "intervalSeconds": 1,
    "minRequests": 3,
    "consecutiveFailureLimit": 2,
}


@contextlib.contextmanager
def prometheus(
    devcluster: ThreadedDevCluster, namespace: str, workdir: Path, selects: Callable[[Obj], bool] = lambda pod: True
) -> Iterator[str]:
    """A real Prometheus scraping the namespace's ready model servers that `selects` keeps (file_sd, rewritten every
    0.5 s, as the demo does); yields its URL."""
    binary = find_prometheus()
    if binary is None:
        pytest.skip("prometheus is not installed: `make prometheus` installs Debian's package")
    started, stop = threading.Event(), threading.Event()
    url: list[str] = []
    failure: list[BaseException] = []

    async def serve() -> None:
        async with LocalPrometheus(binary, workdir) as local:
            url.append(local.url)
            started.set()
            while not stop.is_set():
                local.write_targets([pod for pod in devcluster.list("v1", "Pod", namespace) if selects(pod)])
                await asyncio.sleep(0.5)

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:  # reported to the test below, not lost in the thread
            failure.append(error)
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(60)
    try:
        assert url and not failure, f"Prometheus did not start: {failure}"
        yield url[0]
    finally:
        stop.set()
        thread.join(timeout=30)


def checked_policy(namespace: str, url: str, check: dict[str, Any], **latency: Any) -> dict[str, Any]:
    gate = {**LATENCY, "provider": "Prometheus", "prometheusURL": url, **latency}
    overrides = {"gates.accuracy.enabled": False, "gates.latency": gate, "rollout.bakeSeconds": 3}
    return policy(namespace, **overrides, analysis={"checks": [check]})


def decided(devcluster: ThreadedDevCluster, ns: str, operator: OperatorFactory, body: dict[str, Any]) -> Any:
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))
    devcluster.create(target(ns))
    with users(devcluster, ns), operator():
        devcluster.create(body)
        return wait_decided(devcluster, ns)["status"]


def assert_back_on_bf16(devcluster: ThreadedDevCluster, ns: str) -> None:
    served = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert served["image"] != PATCHED_IMAGE and "fp8" not in " ".join(served.get("args", []))


@pytest.mark.prometheus
def test_a_failing_custom_check_rolls_the_rollout_back_to_bf16(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, tmp_path: Path
) -> None:
    ns = devcluster_namespace
    mean_prefill = (
        "sum(rate(vllm:request_prefill_time_seconds_sum{ {{ canary }} }[{{ window }}])) "
        "/ sum(rate(vllm:request_prefill_time_seconds_count{ {{ canary }} }[{{ window }}]))"
    )
    # A bound no server meets (a mean prefill of at most 1 us): the custom check must breach, TTFT/ITL must not.
    check = {"name": "prefill-time", "query": mean_prefill, "range": {"max": "0.000001"}}
    with prometheus(devcluster, ns, tmp_path) as url:
        status = decided(devcluster, ns, operator, checked_policy(ns, url, check))
    assert status["phase"] == "RolledBack", status
    decision = status["decision"]
    assert decision["reason"] == "CustomCheckBreached", decision
    assert (
        "2 consecutive breaches" in decision["message"]
        and "custom check prefill-time: canary value" in decision["message"]
    )
    assert status["latency"]["last"]["values"]["prefill-time"] > 0.000001
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["LatencyGatePassed"]["status"], conditions["LatencyGatePassed"]["reason"]) == (
        "False",
        "CustomCheckBreached",
    )
    assert conditions["CanaryConfigVerified"]["status"] == "True", "the canary's configuration was read via Prometheus"
    assert_back_on_bf16(devcluster, ns)


@pytest.mark.prometheus
def test_a_canary_prometheus_does_not_scrape_yet_is_verified_from_its_own_metrics(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, tmp_path: Path
) -> None:
    """Issue 23 item 3: Prometheus scrapes what a team's monitor of the target selects (app=llama), so not the canary
    before it joins the target's Service. The served-configuration check reads the canary's own /metrics (it used to
    wait for the progress deadline and roll back); once the canary joins it carries app=llama, Prometheus scrapes
    it, and the latency analysis through Prometheus promotes it."""
    ns = devcluster_namespace

    def targets_monitor(pod: Obj) -> bool:
        return (pod["metadata"].get("labels") or {}).get("app") == "llama"

    gate = {**LATENCY, "provider": "Prometheus"}
    with prometheus(devcluster, ns, tmp_path, targets_monitor) as url:
        body = policy(ns, **{"gates.accuracy.enabled": False, "gates.latency": {**gate, "prometheusURL": url}})
        status = decided(devcluster, ns, operator, body)
    assert status["phase"] == "Promoted", status
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["CanaryConfigVerified"]["status"], conditions["CanaryConfigVerified"]["reason"]) == (
        "True",
        "ServedAsPlanned",
    )


@pytest.mark.prometheus
def test_a_custom_check_without_data_is_handled_like_ttft_no_data(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, tmp_path: Path
) -> None:
    ns = devcluster_namespace
    # The simulator does no speculative decoding: no such series, ever.
    drafts = "sum(vllm:spec_decode_num_drafts_total{ {{ canary }} })"
    check = {"name": "spec-decode", "query": drafts, "range": {"min": "1"}}
    with prometheus(devcluster, ns, tmp_path) as url:
        body = checked_policy(ns, url, check, onInconclusive="Rollback", inconclusiveDeadlineSeconds=15)
        status = decided(devcluster, ns, operator, body)
    assert status["phase"] == "RolledBack", status
    latency = status["latency"]
    assert latency["breaches"] == 0 and latency["passes"] == 0, "NoData never counts as a pass or a breach"
    assert latency["inconclusive"] >= 2
    decision = status["decision"]
    assert decision["reason"] == "AnalysisStalled", decision
    assert "custom check spec-decode: its query returned no series (or NaN) for the canary" in decision["message"]
    assert_back_on_bf16(devcluster, ns)


@pytest.mark.prometheus
def test_a_query_prometheus_rejects_is_a_condition_and_an_event_not_a_crash(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, tmp_path: Path
) -> None:
    ns = devcluster_namespace
    broken = {"name": "broken", "query": "sum(rate(vllm:x{ {{ canary }} }[{{ window }}])", "range": {"max": "1"}}
    with prometheus(devcluster, ns, tmp_path) as url:
        body = checked_policy(ns, url, broken, onInconclusive="Rollback", inconclusiveDeadlineSeconds=5)
        status = decided(devcluster, ns, operator, body)  # the operator fixture fails on any handler exception
    assert status["phase"] == "RolledBack" and status["decision"]["reason"] == "AnalysisStalled", status
    assert "custom check broken: Prometheus at" in status["decision"]["message"], status["decision"]
    assert event_reasons(devcluster, ns).count("CustomCheckQueryRejected") == 1, "one Warning event, as it appears"
    events = [e for e in devcluster.list("v1", "Event", ns) if e["reason"] == "CustomCheckQueryRejected"]
    assert events[0]["type"] == "Warning" and "bad_data" in events[0]["message"], events[0]


# ------------------------------------------------------------------------- a check registered by this test alone


async def _read_canary_ttft(provider: MetricsProvider, policy_: KVPolicy, sides: Sides) -> SideMetrics:
    return await provider.latency_snapshot(sides.canary, 10.0, (0.5,))


def _assess_ttft_slo(policy_: KVPolicy, canary: SideMetrics) -> Verdict:
    """An absolute TTFT objective no server meets (1 us): a test check whose breach is certain once data comes."""
    ttft = canary.ttft_seconds.get(0.5)
    if ttft is None:
        return Verdict(GateVerdict.NO_DATA, AnalysisReason.TOO_FEW_CANARY_REQUESTS, "no canary TTFT in the window")
    if ttft > 0.000001:
        message = f"canary TTFT p50 {ttft * 1000:.3f} ms is above the 0.001 ms objective"
        return Verdict(GateVerdict.BREACH, AnalysisReason.CUSTOM_CHECK_BREACHED, message, values={"ttft-slo": ttft})
    return Verdict(GateVerdict.PASS, AnalysisReason.WITHIN_THRESHOLDS, "within the objective")


TTFT_SLO: MetricsCheck[SideMetrics] = MetricsCheck(
    name="ttft-slo", stage=Stage.ANALYSIS, read=_read_canary_ttft, assess=_assess_ttft_slo
)


def test_a_check_registered_in_the_table_decides_a_rollout_without_controller_changes(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new metrics check is an entry: registered here (the table), read through the configured provider (Scrape:
    the simulator pods' own /metrics) by the generic observer, and reacted to by the generic step."""
    monkeypatch.setattr(metric_checks, "METRICS_CHECKS", (*metric_checks.METRICS_CHECKS, TTFT_SLO))
    ns = devcluster_namespace
    body = policy(ns, **{"gates.accuracy.enabled": False, "gates.latency": LATENCY, "rollout.bakeSeconds": 3})
    status = decided(devcluster, ns, operator, body)
    assert status["phase"] == "RolledBack", status
    assert status["decision"]["reason"] == "CustomCheckBreached", status["decision"]
    assert "above the 0.001 ms objective" in status["decision"]["message"]
    assert status["latency"]["last"]["values"]["ttft-slo"] > 0.000001
    assert_back_on_bf16(devcluster, ns)
