"""The latency gate deciding a ReplicaRatio rollout: the canary joins the users' traffic after the accuracy gate and
the operator compares it with the target's pods by scraping their /metrics (provider Scrape)."""

from __future__ import annotations

import pytest
from e2e_helpers import (
    PATCHED_IMAGE,
    OperatorFactory,
    container,
    event_reasons,
    policy,
    target,
    users,
    wait_decided,
)
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster


def live_policy(namespace: str, ttft_max_ratio: str) -> dict[str, object]:
    return policy(
        namespace,
        **{
            "gates.accuracy.enabled": False,
            "gates.latency": {
                "enabled": True,
                "provider": "Scrape",
                "ttftMaxRatio": ttft_max_ratio,
                "itlMaxRatio": "100",
                "windowSeconds": 10,
                "intervalSeconds": 1,
                "minRequests": 3,
                "consecutiveFailureLimit": 2,
            },
            "rollout.bakeSeconds": 3,
        },
    )


@pytest.mark.parametrize(
    ("ttft_max_ratio", "phase", "gate_condition"),
    [("100", "Promoted", "True"), ("0.01", "RolledBack", "False")],
)
def test_live_latency_analysis_decides_a_replica_ratio_rollout(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    ttft_max_ratio: str,
    phase: str,
    gate_condition: str,
) -> None:
    ns = devcluster_namespace
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))
    devcluster.create(target(ns))
    with users(devcluster, ns) as generator, operator():
        devcluster.create(live_policy(ns, ttft_max_ratio))
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == phase, status
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["LatencyGatePassed"]["status"] == gate_condition
    latency = status["latency"]
    assert latency["checks"] >= 1 and latency["last"]["canaryRequests"] >= 3
    assert "TrafficJoined" in event_reasons(devcluster, ns)
    assert len(generator.counters["llama"].by_endpoint) >= 2, "the users reached the canary too once it joined"
    if phase == "RolledBack":
        assert status["decision"]["reason"] in ("TTFTRatioExceeded", "LatencyRatioExceeded")
        assert container(devcluster.get("apps/v1", "Deployment", "llama", ns))["image"] != PATCHED_IMAGE
    else:
        assert latency["passes"] >= 1


def test_synthetic_traffic_is_judged_by_the_latency_probe_job(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))
    devcluster.create(target(ns))
    synthetic = {
        "gates.accuracy.enabled": False,
        "gates.latency": {"enabled": True, "ttftMaxRatio": "100", "itlMaxRatio": "100"},
        "rollout.traffic": "Synthetic",
    }
    with operator():
        devcluster.create(policy(ns, **synthetic))
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "Promoted", status
    assert status["latency"]["probe"]["verdict"] == "Pass"
    assert status["latency"]["probe"]["job"] == "llama-fp8-latency-g1"
    assert "TrafficJoined" not in event_reasons(devcluster, ns), "synthetic traffic never joins the users' Service"
    assert "LatencyAnalysisStarted" in event_reasons(devcluster, ns)
