"""Random event sequences through the pure step: invariants that must hold whatever the cluster and the user do."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpolicy.api.v1alpha1 import Phase
from kvpolicy.rollout.step_types import Patch
from operator_helpers import Driver, World, gate_output, make_policy, target_deployment

ORIGINAL = target_deployment()
ACTIONS = st.sampled_from(
    [
        "wait",
        "long_wait",
        "canary_up",
        "canary_pending",
        "accuracy_pass",
        "accuracy_fail",
        "probe_pass",
        "probe_breach",
        "abort",
        "clear_abort",
        "pause",
        "resume",
        "edit",
        "approve",
        "retry",
        "gitops_revert",
    ]
)


def act(driver: Driver, action: str, edits: list[int]) -> None:
    world = driver.world
    jobs = list(world.jobs)
    if action == "wait":
        driver.tick(1)
    elif action == "long_wait":
        driver.tick(700)
    elif action == "canary_up":
        world.canary_up()
        driver.tick(1)
    elif action == "canary_pending":
        world.canary_up(ready=False, unschedulable="Insufficient nvidia.com/gpu")
        driver.tick(1)
    elif action in ("accuracy_pass", "accuracy_fail") and any("-accuracy-" in j for j in jobs):
        output = gate_output("Pass" if action == "accuracy_pass" else "Fail", recovery=0.99)
        world.finish_job("accuracy", output, exit_code=0 if action == "accuracy_pass" else 1)
        driver.tick(1)
    elif action in ("probe_pass", "probe_breach") and any("-latency-" in j for j in jobs):
        verdict = "Pass" if action == "probe_pass" else "Breach"
        world.finish_job("latency", f'{{"verdict": "{verdict}", "message": "m"}}', exit_code=0)
        driver.tick(1)
    elif action == "gitops_revert":  # a sync of the original manifest
        world.target = copy.deepcopy(ORIGINAL)
        driver.tick(300)
    elif action in ("abort", "clear_abort", "pause", "resume", "approve", "retry"):
        rollout = driver.policy.status.rollout_id
        field, value = {
            "abort": ("rollout.abort", True),
            "clear_abort": ("rollout.abort", False),
            "pause": ("rollout.paused", True),
            "resume": ("rollout.paused", False),
            "approve": ("rollout.approvedRollout", rollout),
            "retry": ("rollout.retryRollout", rollout),
        }[action]
        driver.edit({field: value})
        driver.tick(1)
    elif action == "edit":
        edits.append(len(edits))
        driver.edit({"gates.accuracy.maxSamples": 50 + len(edits)})
        driver.tick(1)
    else:
        driver.tick(1)


def check_invariants(driver: Driver, before: Any) -> None:
    status = driver.policy.status
    rollout = driver.policy.spec.rollout
    for result in driver.results[before:]:
        if rollout.approval == "Manual" and result.status.phase == Phase.PROMOTING.value:
            assert rollout.approved_rollout == result.status.rollout_id, "promoted without an approval of this rollout"
    assert status.phase in {phase.value for phase in Phase}
    assert len(status.history) <= 10
    generation = driver.policy.metadata["generation"]
    assert all(c.observed_generation == generation for c in status.conditions)
    for result in driver.results[before:]:
        names = [a.name for a in result.actions if isinstance(a, Patch) and a.name == "llama"]
        if names and result.status.phase == Phase.PROMOTING.value:
            assert result.status.previous_template is not None, "target patched before its template was recorded"
    if status.phase == Phase.ROLLED_BACK.value:
        assert driver.world.target == ORIGINAL, "a rollback must leave the target exactly as it was"
        assert not driver.world.deployments and not driver.world.services
    drifted = any(c.type == "Drifted" and c.status == "True" for c in status.conditions)
    if status.phase == Phase.PROMOTED.value and not drifted:
        assert "--kv-cache-dtype" in driver.world.target["spec"]["template"]["spec"]["containers"][0]["args"]
    if status.phase == Phase.PROMOTED.value and drifted:
        assert driver.policy.spec.rollout.paused, "only a paused policy reports the drift of an FP8 decision"
        assert not driver.world.deployments


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=st.lists(ACTIONS, min_size=1, max_size=25),
    synthetic=st.booleans(),
    manual=st.booleans(),
)
def test_random_histories_keep_the_invariants(actions: list[str], synthetic: bool, manual: bool) -> None:
    spec = {
        "gates.latency.enabled": synthetic,
        "rollout.traffic": "Synthetic" if synthetic else "ReplicaRatio",
        "rollout.approval": "Manual" if manual else "Automatic",
    }
    driver = Driver(make_policy(**spec), World())
    driver.tick()
    edits: list[int] = []
    for action in actions:
        before = len(driver.results)
        act(driver, action, edits)
        check_invariants(driver, before)
