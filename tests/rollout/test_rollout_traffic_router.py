"""traffic InferencePool on the pure step: the canary's own pool, the user's HTTPRoute stepped through the weights with
an analysis at each, put back exactly as written on promotion, rollback and restart, the Advisory route patch, and a
step resumed from the status alone."""

from __future__ import annotations

import copy
import dataclasses
import json
from datetime import datetime
from typing import Any

import jsonpatch
import pytest
from kvpolicy.analysis.model import GateVerdict
from kvpolicy.rollout.step_types import Create, Delete, Kind, Observations, Patch, StepResult
from kvpolicy.rollout.traffic_routes import RouteShapeError, original_rules, route_patch, weighted_refs
from operator_helpers import Driver, World, make_policy, run_to_canary, verdict

POOL_REF = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama", "weight": 1}
ROUTED = {
    "gates.accuracy.enabled": False,
    "gates.latency.enabled": True,
    "rollout.traffic": "InferencePool",
    "rollout.inferencePool": {"httpRoute": "llm", "pool": "llama", "steps": [50, 10]},
    "rollout.bakeSeconds": 0,
}
MIRRORING = {"rollout.inferencePool": {**ROUTED["rollout.inferencePool"], "mirrorPercent": 20}}
COPYING = {"rollout.inferencePool": {**ROUTED["rollout.inferencePool"], "endpointPicker": "CopyBaseline"}}


def user_route() -> dict[str, Any]:
    """A route as a user of the GIE guides writes it, with a second rule that sends elsewhere."""
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "llm", "namespace": "default"},
        "spec": {
            "parentRefs": [{"name": "inference-gateway"}],
            "rules": [
                {"matches": [{"path": {"type": "PathPrefix", "value": "/health"}}],
                 "backendRefs": [{"group": "", "kind": "Service", "name": "status", "port": 80, "weight": 1}]},
                {"backendRefs": [dict(POOL_REF)], "timeouts": {"request": "300s"}},
            ],
        },
    }  # fmt: skip


def baseline_pool() -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"app": "llama"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
        },
    }


def picker_objects() -> dict[str, dict[str, Any]]:
    """The baseline pool's EPP as the GIE guides deploy it: a Service and the Deployment it selects."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "llama-epp"},
        "spec": {"selector": {"app": "llama-epp"}, "ports": [{"port": 9002, "targetPort": 9002}]},
    }
    container = {
        "name": "epp",
        "image": "registry.k8s.io/gateway-api-inference-extension/epp:v1.6.0",
        "args": ["--pool-name", "llama", "--pool-namespace", "default", "--config-file", "/config/epp.yaml"],
        "volumeMounts": [{"name": "config", "mountPath": "/config"}],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama-epp"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "llama-epp"}},
            "template": {
                "metadata": {"labels": {"app": "llama-epp"}},
                "spec": {
                    "serviceAccountName": "llama-epp",
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": "llama-epp-config"}}],
                },
            },
        },
    }
    return {"Service/llama-epp": service, "Deployment/llama-epp": deployment}  # fmt: skip


@dataclasses.dataclass
class RoutedWorld(World):
    route: dict[str, Any] | None = dataclasses.field(default_factory=user_route)
    pools: dict[str, dict[str, Any]] = dataclasses.field(default_factory=lambda: {"llama": baseline_pool()})
    pickers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=picker_objects)
    route_writes: int = 0

    def apply(self, result: StepResult) -> None:
        rest = []
        for action in result.actions:
            key = f"{action.kind}/{action.name}"
            if "-epp-" in action.name and isinstance(action, Create):  # the copied EPP: ready at once
                self.pickers[key] = {**copy.deepcopy(action.body), "status": {"readyReplicas": 1}}
            elif "-epp-" in action.name and isinstance(action, Delete):
                self.pickers.pop(key, None)
            elif action.kind == Kind.HTTP_ROUTE:
                assert isinstance(action, Patch) and action.patch_type == "json" and self.route is not None
                self.route = jsonpatch.apply_patch(self.route, action.patch)  # a failed `test` raises
                self.route_writes += 1
            elif action.kind == Kind.INFERENCE_POOL and isinstance(action, Create):
                self.pools.setdefault(action.name, copy.deepcopy(action.body))
            elif action.kind == Kind.INFERENCE_POOL and isinstance(action, Delete):
                self.pools.pop(action.name, None)
            else:
                rest.append(action)
        super().apply(dataclasses.replace(result, actions=tuple(rest)))

    def observe(self, now: datetime, phase: str | None = None, **extra: Any) -> Observations:
        found = {"route": self.route, "pools": self.pools, "pickers": self.pickers}
        return super().observe(now, phase, **copy.deepcopy(found), **extra)


def weights(world: RoutedWorld) -> list[tuple[str, int]]:
    assert world.route is not None
    refs = world.route["spec"]["rules"][1]["backendRefs"]
    return [(ref["name"], ref["weight"]) for ref in refs]


def routed(**spec: Any) -> tuple[Driver, RoutedWorld, str]:
    """A routed rollout whose canary is up, at the first step's weight: the driver, its world, the canary's name."""
    world = RoutedWorld()
    driver = Driver(make_policy(**{**ROUTED, **spec}), world=world)
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "LatencyAnalysis"
    driver.tick()
    assert driver.policy.status.canary is not None
    return driver, world, driver.policy.status.canary.deployment


def test_the_canary_gets_a_pool_of_its_own_and_the_route_the_first_steps_share() -> None:
    driver, world, canary = routed()
    pool = world.pools[canary]
    # Only the canary's pods: its own labels, none of the target's (the baseline pool must not select them).
    assert pool["spec"]["selector"]["matchLabels"] == {
        "kvpolicy.dev/policy": "llama-fp8",
        "kvpolicy.dev/canary": canary,
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert "endpointPickerRef" not in pool["spec"]
    assert weights(world) == [("llama", 90), (canary, 10)], "steps are taken in ascending order"
    assert world.route is not None
    assert world.route["spec"]["rules"][0] == user_route()["spec"]["rules"][0], "other rules are not touched"
    assert driver.condition("TrafficRouted") == ("True", "TrafficShifted")
    assert driver.policy.status.latency is not None and driver.policy.status.latency.started_at is not None
    traffic = driver.policy.status.traffic
    assert traffic is not None and (traffic.step, traffic.weight) == (0, 10)
    assert "TrafficShifted" in driver.reasons()


def test_each_step_is_analysed_then_promotion_puts_the_route_back_exactly() -> None:
    driver, world, canary = routed()
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    assert driver.phase == "LatencyAnalysis"
    assert weights(world) == [("llama", 50), (canary, 50)]
    assert driver.policy.status.traffic is not None and driver.policy.status.traffic.step == 1
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    for _ in range(3):
        driver.tick()
    assert driver.phase == "Promoted", driver.policy.status.message
    assert world.route == user_route(), "the route is exactly as the user wrote it"
    assert canary not in world.pools and "llama" in world.pools
    assert driver.policy.status.traffic is None
    assert driver.condition("TrafficRouted") == ("False", "TrafficRestored")


def test_a_breach_rolls_back_and_the_route_is_as_written_before_the_canary_goes() -> None:
    driver, world, _ = routed(**{"gates.latency.consecutiveFailureLimit": 1})
    driver.tick(60, latency_verdict=verdict(GateVerdict.BREACH))
    assert driver.phase in ("RollingBack", "RolledBack")
    for _ in range(3):
        driver.tick()
    assert driver.phase == "RolledBack"
    assert world.route == user_route()
    assert set(world.pools) == {"llama"}
    rollback = [result for result in driver.results if any(a.kind == Kind.HTTP_ROUTE for a in result.actions)][-1]
    kinds = [action.kind for action in rollback.actions]
    assert kinds.index(Kind.HTTP_ROUTE) < kinds.index(Kind.DEPLOYMENT), "the route is restored before the canary goes"


def test_a_spec_edit_mid_rollout_puts_the_route_back_first() -> None:
    driver, world, _ = routed()
    driver.edit({"rollout.bakeSeconds": 30})
    result = driver.tick()
    assert [a.kind for a in result.actions][:2] == [Kind.HTTP_ROUTE, Kind.INFERENCE_POOL]
    assert world.route == user_route()


def test_an_operator_restart_resumes_at_the_weight_it_had_reached() -> None:
    driver, world, _ = routed()
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    writes = world.route_writes
    # A new operator has only the status: the next passes write nothing to the route and keep analysing step 2.
    resumed = Driver(make_policy(**ROUTED, status=driver.policy.status.to_k8s()), world=world, now=driver.now)
    resumed.tick(1)
    resumed.tick(1)
    assert world.route_writes == writes
    traffic = resumed.policy.status.traffic
    assert traffic is not None and (traffic.step, traffic.weight) == (1, 50)


def test_advisory_publishes_the_route_patch_and_waits_for_it() -> None:
    driver, world, canary = routed(**{"rollout.applyMode": "Advisory"})
    assert world.route == user_route(), "Advisory never writes the forward steps"
    traffic = driver.policy.status.traffic
    assert traffic is not None and traffic.advice is not None
    assert driver.condition("TrafficRouted") == ("Unknown", "RouteChangeAdvised")
    assert "kubectl patch httproute llm --type json" in driver.policy.status.message
    assert canary in world.pools, "the canary's pool is the operator's own"
    world.route = jsonpatch.apply_patch(world.route, json.loads(traffic.advice))  # what a GitOps sync applies
    driver.tick()
    assert driver.condition("TrafficRouted") == ("True", "TrafficShifted")


def test_a_route_the_rollout_cannot_use_rolls_back_after_the_progress_deadline() -> None:
    driver = Driver(make_policy(**ROUTED), world=RoutedWorld(route=None))
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "LatencyAnalysis"
    assert driver.condition("TrafficRouted") == ("False", "TrafficRouteUnusable")
    driver.tick(2000)
    for _ in range(3):
        driver.tick()
    assert driver.phase == "RolledBack"
    assert driver.policy.status.decision is not None
    assert driver.policy.status.decision.reason == "TrafficRouteUnusable"


def test_rules_that_split_the_pool_with_other_backends_are_refused_by_name() -> None:
    route = user_route()
    route["spec"]["rules"][1]["backendRefs"].append({"name": "other", "port": 80, "weight": 1})
    spec = make_policy(**ROUTED).spec.rollout.inference_pool
    assert spec is not None
    with pytest.raises(RouteShapeError, match="rule 1 sends traffic to InferencePool llama and to 1 other backend"):
        original_rules(route, spec, "default")


def test_the_route_patch_tests_what_it_replaces_and_is_empty_when_there() -> None:
    route = user_route()
    spec = make_policy(**ROUTED).spec.rollout.inference_pool
    assert spec is not None
    records = original_rules(route, spec, "default")
    ops = route_patch(route, records, "llama-canary", 10)
    assert ops[0] == {"op": "test", "path": "/spec/rules/1/backendRefs", "value": [POOL_REF]}
    assert ops[1]["op"] == "replace"
    shifted = jsonpatch.apply_patch(route, ops)
    assert route_patch(shifted, records, "llama-canary", 10) == []
    assert jsonpatch.apply_patch(shifted, route_patch(shifted, records, "llama-canary", 0)) == route
    assert weighted_refs([POOL_REF], "c", 0) == [POOL_REF]


def test_copy_baseline_gives_the_canarys_pool_a_copy_of_the_baselines_endpoint_picker() -> None:
    driver, world, canary = routed(**COPYING)
    assert weights(world) == [("llama", 90), (canary, 10)]
    traffic = driver.policy.status.traffic
    assert traffic is not None and traffic.endpoint_picker == "llama-fp8-epp-g1"
    deployment, service = world.pickers["Deployment/llama-fp8-epp-g1"], world.pickers["Service/llama-fp8-epp-g1"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["--pool-name", canary], "it picks for the canary's pool"
    assert container["args"][2:] == ["--pool-namespace", "default", "--config-file", "/config/epp.yaml"]
    assert deployment["spec"]["template"]["spec"]["volumes"] == picker_objects()["Deployment/llama-epp"]["spec"][
        "template"]["spec"]["volumes"], "the baseline's configuration"  # fmt: skip
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert "app" not in labels and "kvpolicy.dev/canary" not in labels, "neither EPP Service nor canary pool selects it"
    assert service["spec"]["selector"] == labels and service["spec"]["ports"] == [{"port": 9002, "targetPort": 9002}]
    assert world.pools[canary]["spec"]["endpointPickerRef"] == {
        "name": "llama-fp8-epp-g1",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    for _ in range(3):
        driver.tick()
    assert driver.phase == "Promoted"
    assert set(world.pickers) == set(picker_objects()), "the copy is removed with the canary's pool"


def test_copy_baseline_without_an_endpoint_picker_to_copy_is_unusable() -> None:
    world = RoutedWorld(pickers={})
    driver = Driver(make_policy(**{**ROUTED, **COPYING}), world=world)
    run_to_canary(driver)
    driver.tick()
    assert driver.condition("TrafficRouted") == ("False", "TrafficRouteUnusable")
    assert "Service llama-epp (the endpoint picker of InferencePool llama) not found" in driver.policy.status.message
    assert world.route == user_route()


def test_a_mirror_phase_copies_requests_to_the_canary_before_any_user_is_answered_by_it() -> None:
    driver, world, canary = routed(**MIRRORING)
    assert world.route is not None
    rule = world.route["spec"]["rules"][1]
    assert rule["backendRefs"] == [POOL_REF], "no user is answered by the canary while mirroring"
    assert rule["filters"] == [
        {
            "type": "RequestMirror",
            "requestMirror": {
                "backendRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": canary},
                "percent": 20,
            },
        }
    ]
    assert driver.condition("TrafficRouted") == ("True", "TrafficShifted")
    assert "(mirror phase)" in driver.policy.status.message
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    assert weights(world) == [("llama", 90), (canary, 10)] and "filters" not in world.route["spec"]["rules"][1]
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    for _ in range(3):
        driver.tick()
    assert driver.phase == "Promoted"
    assert world.route == user_route()


def test_a_rollback_in_the_mirror_phase_removes_the_filter_and_keeps_the_users_own() -> None:
    world = RoutedWorld()
    assert world.route is not None
    own = {"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "x-team", "value": "a"}]}}
    world.route["spec"]["rules"][1]["filters"] = [own]
    written = copy.deepcopy(world.route)
    driver = Driver(make_policy(**{**ROUTED, **MIRRORING, "gates.latency.consecutiveFailureLimit": 1}), world=world)
    run_to_canary(driver)
    driver.tick()
    driver.tick()
    assert [f["type"] for f in world.route["spec"]["rules"][1]["filters"]] == ["RequestHeaderModifier", "RequestMirror"]
    driver.tick(60, latency_verdict=verdict(GateVerdict.BREACH))
    for _ in range(3):
        driver.tick()
    assert driver.phase == "RolledBack"
    assert world.route == written


# ------------------------------------------------------------------------------------ ReplicaRatio behind a pool


def test_replica_ratio_behind_a_pool_that_selects_the_target_is_warned_about_by_name() -> None:
    world = RoutedWorld()
    other = copy.deepcopy(baseline_pool())
    other["metadata"]["name"] = "other"
    other["spec"]["selector"]["matchLabels"] = {"app": "someone-else"}
    world.pools["other"] = other
    driver = Driver(make_policy(**{"gates.accuracy.enabled": False}), world=world)
    driver.tick()
    assert driver.condition("ReplicaRatioHolds") == ("False", "InferencePoolSelectsTarget")
    [warning] = [e for r in driver.results for e in r.events if e.reason == "InferencePoolSelectsTarget"]
    assert warning.type == "Warning"
    assert warning.message.startswith("InferencePool llama selects the pods of llama:")
    assert "other" not in warning.message.split(":")[0]
    assert "rollout.traffic InferencePool" in warning.message


def test_replica_ratio_without_a_selecting_pool_holds() -> None:
    world = RoutedWorld(pools={})
    driver = Driver(make_policy(**{"gates.accuracy.enabled": False}), world=world)
    driver.tick()
    assert driver.condition("ReplicaRatioHolds") == ("True", "NoInferencePool")
    assert "InferencePoolSelectsTarget" not in driver.reasons()


def test_a_policy_found_to_be_governed_elsewhere_mid_rollout_puts_the_route_back_first() -> None:
    driver, world, _ = routed()
    result = driver.tick(1, governed_by="older-policy")
    assert [a.kind for a in result.actions][:2] == [Kind.HTTP_ROUTE, Kind.INFERENCE_POOL]
    assert world.route == user_route()
    assert set(world.pools) == {"llama"}
