"""One target, one policy: the policy created first governs the Deployment; a second one is refused (Conflict), writes
nothing, and proceeds once the first is gone."""

from __future__ import annotations

from typing import Any

from kvpolicy.rollout.ownership import governing_policy
from operator_helpers import Driver, make_policy, run_to_canary


def peer(name: str, created: str, target: str | None = "llama", uid: str | None = None) -> dict[str, Any]:
    spec = {"targetRef": {"name": target}} if target else {"targetRef": "garbled"}
    return {"metadata": {"name": name, "uid": uid or f"uid-{name}", "creationTimestamp": created}, "spec": spec}


def test_the_policy_created_first_governs_the_target() -> None:
    me = peer("b", "2026-01-01T00:00:05Z")
    older = peer("a", "2026-01-01T00:00:01Z")
    assert governing_policy(me["metadata"], "llama", [me, older]) == "a"
    assert governing_policy(older["metadata"], "llama", [me, older]) is None
    assert governing_policy(me["metadata"], "other", [me, older]) is None, "another target is no conflict"
    assert governing_policy(me["metadata"], "llama", [me]) is None
    assert governing_policy(me["metadata"], "llama", []) is None, "a list that lags behind a create"


def test_ties_go_to_the_name_first_in_order_and_unreadable_specs_claim_nothing() -> None:
    same = "2026-01-01T00:00:01Z"
    first, second = peer("alpha", same), peer("beta", same)
    assert governing_policy(second["metadata"], "llama", [first, second]) == "alpha"
    assert governing_policy(first["metadata"], "llama", [first, second]) is None
    garbled = peer("old", "2020-01-01T00:00:00Z", target=None)
    assert governing_policy(second["metadata"], "llama", [garbled, second]) is None


def test_a_second_policy_is_refused_writes_nothing_and_proceeds_once_the_first_is_gone() -> None:
    driver = Driver(make_policy())
    refused = driver.tick(governed_by="first-policy")
    assert refused.actions == () and driver.world.target_patches == 0
    assert driver.phase == "Planning" and driver.condition("Ready") == ("False", "Conflict")
    message = driver.policy.status.conditions[0].message
    assert message == (
        "Deployment llama is governed by KVPolicy first-policy (created first); waiting until it is deleted"
    )
    driver.tick(governed_by="first-policy")
    assert driver.reasons().count("Conflict") == 1, "one Warning event, not one per pass"
    driver.tick()
    assert driver.phase == "CanaryStarting" and "Deployment/llama-fp8-canary-g1" in driver.world.creates


def test_a_policy_whose_target_is_taken_over_mid_rollout_removes_its_canary() -> None:
    driver = Driver(make_policy())
    run_to_canary(driver)
    assert driver.world.deployments
    driver.tick(governed_by="older-policy")
    assert driver.world.deployments == {} and driver.world.services == {}
    assert driver.phase == "Planning" and driver.condition("Ready") == ("False", "Conflict")
    assert driver.world.target_patches == 0
