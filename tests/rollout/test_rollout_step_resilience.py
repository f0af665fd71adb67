"""The pure step where the world changes under a rollout: a latency analysis that stalls on Hold, and GPU facts that
change after planning (nodes relabelled, labels missing at planning and back later)."""

from __future__ import annotations

import pytest
from fake_kube import FakeKubeApi
from kvpolicy.api.v1alpha1 import GateVerdict, GpuFacts
from kvpolicy.kube.api import DEPLOYMENTS, NODES
from kvpolicy.kube.observe import Observer
from kvpolicy.planning.gpu import KNOWN_PRODUCTS, gpu_facts, planning_change
from kvpolicy.rollout.rules import rollout_hash
from kvpolicy.rollout.step_types import Event
from operator_helpers import (
    NAMESPACE,
    T0,
    Driver,
    World,
    gpu,
    live,
    make_policy,
    run_to_canary,
    target_deployment,
    verdict,
)


def stall_events(reasons: list[str]) -> int:
    return reasons.count("AnalysisStalled")


def test_a_stalled_analysis_on_hold_warns_once_per_stall_while_the_canary_keeps_serving() -> None:
    driver = live(**{"gates.latency.inconclusiveDeadlineSeconds": 100, "rollout.bakeSeconds": 3600})
    driver.tick(60, latency_verdict=verdict(GateVerdict.NO_DATA))
    assert stall_events(driver.reasons()) == 0, "inconclusive, but not stalled yet"
    stalled = driver.tick(120, latency_verdict=verdict(GateVerdict.NO_DATA))
    [warning] = [event for event in stalled.events if event.reason == "AnalysisStalled"]
    assert warning.type == "Warning"
    assert "no conclusive check for 120 s" in warning.message and "keeps serving" in warning.message
    for _ in range(3):  # every later check of the same stall: no new event
        driver.tick(60, latency_verdict=verdict(GateVerdict.NO_DATA))
    assert stall_events(driver.reasons()) == 1
    assert driver.phase == "LatencyAnalysis" and driver.world.deployments, "the canary still runs"
    assert driver.condition("LatencyGatePassed") == ("Unknown", "AnalysisStalled")

    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))  # the stall ends ...
    driver.tick(60, latency_verdict=verdict(GateVerdict.NO_DATA))
    driver.tick(120, latency_verdict=verdict(GateVerdict.NO_DATA))  # ... and a new one begins
    assert stall_events(driver.reasons()) == 2


# --- GPU facts after planning ------------------------------------------------------------------------------------


def to_accuracy_gate(driver: Driver) -> None:
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "AccuracyGate" and "llama-fp8-accuracy-g1" in driver.world.jobs


def gpu_changes(driver: Driver) -> list[Event]:
    return [event for result in driver.results for event in result.events if event.reason == "GPUChanged"]


def test_nodes_relabelled_mid_rollout_plan_again_and_remove_the_canary() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.world.gpu = gpu("A100")  # the pool's nodes were relabelled: Hopper -> Ampere
    driver.tick()
    [warning] = gpu_changes(driver)
    assert warning.type == "Warning"
    assert warning.message.startswith("the target's GPU nodes changed: NVIDIA-H200 (Hopper, compute capability 9.0)")
    assert "-> NVIDIA-A100-SXM4-80GB (Ampere, compute capability 8.0); planning the rollout again" in warning.message
    assert driver.phase == "HeldBF16" and driver.policy.status.decision.reason == "NoFP8TensorCores"
    assert driver.policy.status.gpu.generation == "Ampere"
    assert not driver.world.deployments and not driver.world.services and not driver.world.jobs, "canary, Services, Job"


def test_a_plan_held_on_an_unknown_gpu_is_made_again_when_the_labels_appear() -> None:
    driver = Driver(make_policy(), World(gpu=gpu_facts([])))  # GPU Feature Discovery had not labelled the nodes yet
    driver.tick()
    assert driver.phase == "HeldBF16" and driver.policy.status.decision.reason == "UnknownGPU"
    driver.tick(300)
    assert driver.phase == "HeldBF16" and not gpu_changes(driver), "nothing known yet: nothing to plan again"
    driver.world.gpu = gpu("H200")
    driver.tick(300)
    assert [event.type for event in gpu_changes(driver)] == ["Warning"]
    assert driver.phase == "CanaryStarting" and driver.condition("Planned") == ("True", "FP8Planned")
    assert [decision.reason for decision in driver.policy.status.history] == ["UnknownGPU"]


@pytest.mark.parametrize(
    "observed",
    [
        gpu_facts([]),  # every node lost its labels or left the pool: nothing is known, the gates judge the pool
        gpu_facts([{"kvpolicy.dev/node-pool": "h200"}]),  # nodes without GPU labels (GFD restarting)
        gpu("H100"),  # another Hopper product, same compute capability: the same plan
        gpu_facts([KNOWN_PRODUCTS["H200"]] * 4),  # more nodes of the same GPU
    ],
    ids=["no-nodes", "unlabelled", "same-generation", "more-nodes"],
)
def test_gpu_facts_that_cannot_change_the_plan_leave_the_rollout_alone(observed: GpuFacts) -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.world.gpu = observed
    driver.tick()
    assert driver.phase == "AccuracyGate" and not gpu_changes(driver)
    assert driver.policy.status.gpu == gpu("H200"), "the facts the plan was made on stay recorded"


def test_a_paused_rollout_plans_again_only_once_resumed() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.edit({"rollout.paused": True})
    driver.world.gpu = gpu("A100")
    driver.tick()
    assert driver.phase == "AccuracyGate" and not gpu_changes(driver)
    driver.edit({"rollout.paused": False})
    driver.tick()
    assert driver.phase == "HeldBF16" and len(gpu_changes(driver)) == 1


@pytest.mark.parametrize(
    ("planned", "observed", "changed"),
    [
        ("H200", "A100", True),
        ("B200", "RTX-5090", True),  # both Blackwell; 10.0 and 12.0 run different attention backends
        ("H100", "H200", False),
        ("L40S", "L4", False),
    ],
)
def test_planning_change_compares_generation_and_compute_capability(planned: str, observed: str, changed: bool) -> None:
    assert (planning_change(gpu(planned), gpu(observed)) is not None) == changed


def test_planning_change_counts_a_pool_becoming_mixed() -> None:
    mixed = gpu_facts([KNOWN_PRODUCTS["H200"], KNOWN_PRODUCTS["A100"]])
    assert planning_change(gpu("H200"), mixed) == (
        "NVIDIA-H200 (Hopper, compute capability 9.0) -> NVIDIA-A100-SXM4-80GB (Ampere, compute capability 8.0, "
        "mixed generations)"
    )


@pytest.mark.parametrize(("phase", "reads_nodes"), [("AccuracyGate", True), ("HeldBF16", True), ("Promoted", False)])
async def test_the_observer_reads_the_pools_gpus_while_the_plan_still_steers(phase: str, reads_nodes: bool) -> None:
    api = FakeKubeApi()
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["A100"], "pool": "h200"}}})
    canary = {"deployment": "llama-fp8-canary-g1", "service": "llama-fp8-canary-g1", "generation": 1}
    status = {"phase": phase, "specHash": rollout_hash(make_policy().spec), "canary": canary}
    observed = await Observer(api).observe(make_policy(status=status), T0)
    assert ("list nodes" in api.calls) == reads_nodes
    assert (observed.gpu == gpu("A100")) == reads_nodes
