"""traffic InferencePool end to end, on the dev cluster serving the upstream HTTPRoute v1 and InferencePool v1 CRDs:
the operator steps the user's route through the weights while users reach the pools through it (route_traffic.py),
promotes or rolls back with the route exactly as the user wrote it, and an operator stopped mid-step resumes at the
weight it had reached."""

from __future__ import annotations

from typing import Any

import pytest
from e2e_helpers import (
    MODEL,
    PATCHED_IMAGE,
    OperatorFactory,
    container,
    deployment,
    event_reasons,
    policy,
    target,
    users,
    wait_decided,
    wait_until,
)
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster
from route_traffic import POOL_API, ROUTE_API, route_users, route_weights

pytestmark = pytest.mark.usefixtures("gateway_api")
KVP = ("kvpolicy.dev/v1alpha1", "KVPolicy")


def user_objects(ns: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The baseline InferencePool and the HTTPRoute as a user of the GIE guides writes them."""
    pool = {
        "apiVersion": POOL_API[0],
        "kind": POOL_API[1],
        "metadata": {"name": "llama", "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": [{"number": 8000}]},
    }
    route = {"apiVersion": ROUTE_API[0], "kind": ROUTE_API[1], "metadata": {"name": "llm", "namespace": ns},
             "spec": {"parentRefs": [{"name": "inference-gateway"}],
                      "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                  "name": "llama"}],
                                 "timeouts": {"request": "300s"}}]}}  # fmt: skip
    return pool, route


def routed_policy(ns: str, ttft_max_ratio: str = "100", bake: int = 2) -> dict[str, Any]:
    return policy(
        ns,
        **{
            "gates.accuracy.enabled": False,
            "gates.latency": {"enabled": True, "provider": "Scrape", "ttftMaxRatio": ttft_max_ratio,
                              "itlMaxRatio": "100", "windowSeconds": 10, "intervalSeconds": 1, "minRequests": 2,
                              "consecutiveFailureLimit": 2},
            "rollout.bakeSeconds": bake,
            "rollout.traffic": "InferencePool",
            "rollout.inferencePool": {"httpRoute": "llm", "pool": "llama", "steps": [10, 50]},
        },
    )  # fmt: skip


def setup(devcluster: ThreadedDevCluster, ns: str) -> dict[str, Any]:
    """Target, baseline pool and route; the route as the API server stores it (its schema's defaults applied)."""
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))
    devcluster.create(target(ns))
    pool, route = user_objects(ns)
    devcluster.create(pool)
    return devcluster.create(route)["spec"]


def route_spec(devcluster: ThreadedDevCluster, ns: str) -> dict[str, Any]:
    spec: dict[str, Any] = devcluster.get(*ROUTE_API, "llm", ns)["spec"]
    return spec


def canary_share(devcluster: ThreadedDevCluster, ns: str) -> int:
    weights = route_weights(devcluster.get(*ROUTE_API, "llm", ns))
    return next((weight for name, weight in weights.items() if name != "llama"), 0)


@pytest.mark.parametrize(("ttft_max_ratio", "phase"), [("100", "Promoted"), ("0.01", "RolledBack")])
def test_the_route_is_stepped_and_left_exactly_as_written(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    ttft_max_ratio: str,
    phase: str,
) -> None:
    ns = devcluster_namespace
    written = setup(devcluster, ns)
    seen: set[int] = set()
    with route_users(devcluster, ns, "llm", MODEL) as users, operator():
        devcluster.create(routed_policy(ns, ttft_max_ratio))

        def decided() -> bool:
            seen.add(canary_share(devcluster, ns))
            found = devcluster.find(*KVP, "llama-fp8", ns) or {}
            return found.get("status", {}).get("phase") in ("Promoted", "RolledBack")

        wait_until(decided, "a decision", timeout=90)
        status = wait_decided(devcluster, ns)["status"]
    assert status["phase"] == phase, status
    assert route_spec(devcluster, ns) == written, "the route is exactly as the user wrote it"
    pools = {pool["metadata"]["name"] for pool in devcluster.list(*POOL_API, ns)}
    assert pools == {"llama"}, "the canary's pool is removed"
    assert "traffic" not in status
    reasons = event_reasons(devcluster, ns)
    assert "TrafficShifted" in reasons and "TrafficRestored" in reasons
    assert users.served["llama"] > 0
    assert sum(count for pool, count in users.served.items() if pool != "llama") > 0, "users reached the canary"
    target_image = container(devcluster.get("apps/v1", "Deployment", "llama", ns))["image"]
    if phase == "Promoted":
        assert seen >= {10, 50}, f"both steps' weights were on the route: {sorted(seen)}"
        assert reasons.count("TrafficShifted") == 2
        assert target_image == PATCHED_IMAGE
    else:
        assert 50 not in seen, "a canary failing at 10% never gets 50%"
        assert status["decision"]["reason"] in ("TTFTRatioExceeded", "LatencyRatioExceeded")
        assert target_image != PATCHED_IMAGE


def test_an_operator_stopped_mid_step_resumes_at_the_weight_it_had_reached(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    written = setup(devcluster, ns)
    with route_users(devcluster, ns, "llm", MODEL):
        with operator():
            # A long bake at each step: the operator is stopped while the second step bakes.
            devcluster.create(routed_policy(ns, bake=8))
            wait_until(lambda: canary_share(devcluster, ns) == 50, "the second step's weight", timeout=90)
        stopped_at = len(devcluster.writes())
        assert canary_share(devcluster, ns) == 50, "stopping the operator leaves the route where it was"
        with operator():
            wait_until(
                lambda: (devcluster.find(*KVP, "llama-fp8", ns) or {}).get("status", {}).get("phase") == "Promoted",
                "the promotion",
                timeout=90,
            )
    route_writes = [record for record in devcluster.writes()[stopped_at:] if record.resource == "httproutes"]
    assert len(route_writes) == 1, f"only the restore, no step written again: {route_writes}"
    assert route_spec(devcluster, ns) == written


def test_deleting_the_policy_mid_rollout_puts_the_route_back(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    written = setup(devcluster, ns)
    with route_users(devcluster, ns, "llm", MODEL), operator():
        devcluster.create(routed_policy(ns, bake=60))
        wait_until(lambda: canary_share(devcluster, ns) == 10, "the first step's weight", timeout=90)
        devcluster.delete(*KVP, "llama-fp8", ns)
        wait_until(lambda: devcluster.find(*KVP, "llama-fp8", ns) is None, "the policy's deletion", timeout=60)
    assert route_spec(devcluster, ns) == written
    assert {pool["metadata"]["name"] for pool in devcluster.list(*POOL_API, ns)} == {"llama"}


def test_replica_ratio_warns_when_an_inference_pool_selects_the_target(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = devcluster_namespace
    monkeypatch.setenv("KVPOLICY_READ_INFERENCE_POOLS", "true")  # the chart sets it with gatewayAPI.enabled
    setup(devcluster, ns)
    with operator():
        devcluster.create(policy(ns, **{"gates.accuracy.enabled": False}))

        def warned() -> dict[str, Any] | None:
            found = devcluster.find(*KVP, "llama-fp8", ns) or {}
            conditions = {c["type"]: c for c in found.get("status", {}).get("conditions", [])}
            return conditions.get("ReplicaRatioHolds")

        condition = wait_until(warned, "the ReplicaRatioHolds condition", timeout=60)
        wait_decided(devcluster, ns)
    assert (condition["status"], condition["reason"]) == ("False", "InferencePoolSelectsTarget")
    events = [e for e in devcluster.list("v1", "Event", ns) if e["reason"] == "InferencePoolSelectsTarget"]
    assert [e["type"] for e in events] == ["Warning"]
    assert events[0]["message"].startswith("InferencePool llama selects the pods of llama")


def test_a_canary_the_gateway_never_sends_to_is_said_to_get_no_traffic_and_never_passes(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    setup(devcluster, ns)
    # A data plane that ignores the route: every request goes to the target's pods (app=llama), none to the canary.
    with users(devcluster, ns), operator():
        devcluster.create(routed_policy(ns))

        def share_condition() -> dict[str, Any] | None:
            found = devcluster.find(*KVP, "llama-fp8", ns) or {}
            conditions = {c["type"]: c for c in found.get("status", {}).get("conditions", [])}
            condition = conditions.get("TrafficShareAsIntended")
            return condition if condition and condition["status"] == "False" else None

        condition = wait_until(share_condition, "the share condition", timeout=90)
        status = devcluster.get(*KVP, "llama-fp8", ns)["status"]
    assert condition["reason"] == "NoCanaryTraffic", condition
    assert status["phase"] == "LatencyAnalysis" and status["latency"]["passes"] == 0
    assert status["trafficShare"]["measuredPercent"] == 0 and status["trafficShare"]["intendedPercent"] == 10
    assert "NoCanaryTraffic" in event_reasons(devcluster, ns)


def test_copy_baseline_runs_a_copy_of_the_baselines_endpoint_picker_for_the_canarys_pool(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    setup(devcluster, ns)
    picker = {"endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}}
    devcluster.apply({"apiVersion": POOL_API[0], "kind": POOL_API[1], "metadata": {"name": "llama", "namespace": ns},
                      "spec": picker})  # fmt: skip
    epp_args = ["--pool-name", "llama", "--pool-namespace", ns]
    devcluster.create(deployment(ns, "llama-epp", "cpu", {"image": "epp:v1.6.0", "args": epp_args}))
    epp_service = {"selector": {"app": "llama-epp"}, "ports": [{"port": 9002, "targetPort": 9002}]}
    devcluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama-epp", "namespace": ns},
                       "spec": epp_service})  # fmt: skip
    spec = routed_policy(ns, bake=3)
    spec["spec"]["rollout"]["inferencePool"]["endpointPicker"] = "CopyBaseline"
    copied: dict[str, Any] = {}
    with route_users(devcluster, ns, "llm", MODEL), operator():
        devcluster.create(spec)

        def picker_in_use() -> bool:
            found = devcluster.find("apps/v1", "Deployment", "llama-fp8-epp-g1", ns)
            pools = {p["metadata"]["name"]: p for p in devcluster.list(*POOL_API, ns)}
            canary_pool = pools.get("llama-fp8-canary-g1")
            if found is None or canary_pool is None or canary_share(devcluster, ns) == 0:
                return False
            copied.update(
                deployment=found, pool=canary_pool, service=devcluster.get("v1", "Service", "llama-fp8-epp-g1", ns)
            )
            return True

        wait_until(picker_in_use, "the canary's pool, its copied endpoint picker and a share of the route", timeout=90)
        status = wait_decided(devcluster, ns)["status"]
    assert status["phase"] == "Promoted", status
    assert copied["pool"]["spec"]["endpointPickerRef"]["name"] == "llama-fp8-epp-g1"
    assert container(copied["deployment"])["args"] == ["--pool-name", "llama-fp8-canary-g1", "--pool-namespace", ns]
    assert copied["service"]["spec"]["ports"][0]["port"] == 9002
    assert devcluster.find("apps/v1", "Deployment", "llama-fp8-epp-g1", ns) is None, "removed with the canary's pool"
    assert devcluster.find("v1", "Service", "llama-fp8-epp-g1", ns) is None
    assert devcluster.find("apps/v1", "Deployment", "llama-epp", ns) is not None, "the baseline's EPP stays"
