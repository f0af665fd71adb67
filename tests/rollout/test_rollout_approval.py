"""A rollout waiting for its Manual approval (issue 23 item 5), on the pure step: a canary serving users keeps being
analysed (a breach while waiting rolls back), the wait has a deadline (approvalTimeoutSeconds, then a rollback), and an
approval promotes only on a recent passing check."""

from __future__ import annotations

from datetime import timedelta

import pytest
from kvpolicy.api.v1alpha1 import GateVerdict, KVPolicy
from kvpolicy.rollout.rules import latency_check_due, phase_deadline, rollout_hash, stale_evidence
from operator_helpers import Driver, live, make_policy, policy_spec, run_to_canary, verdict
from pydantic import ValidationError

MANUAL = {"rollout.approval": "Manual", "gates.latency.intervalSeconds": 60, "gates.latency.windowSeconds": 60}


def awaiting_live(**spec: object) -> Driver:
    """A ReplicaRatio canary that joined the users' traffic, passed its analysis and waits for its approval."""
    driver = live(**MANUAL, **spec)
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    assert driver.phase == "AwaitingApproval", driver.policy.status.message
    return driver


def approve(driver: Driver) -> None:
    driver.edit({"rollout.approvedRollout": driver.policy.status.rollout_id})


def test_a_waiting_canary_that_serves_users_is_still_analysed_and_a_breach_rolls_it_back() -> None:
    driver = awaiting_live(**{"gates.latency.consecutiveFailureLimit": 2})
    assert latency_check_due(driver.policy, driver.now + timedelta(seconds=60)), "the checks go on while it waits"
    driver.tick(60, latency_verdict=verdict(GateVerdict.BREACH))
    assert driver.phase == "AwaitingApproval" and driver.reasons().count("LatencyBreach") == 1
    assert driver.condition("LatencyGatePassed") == ("Unknown", "Breach")
    driver.tick(60, latency_verdict=verdict(GateVerdict.BREACH))
    assert driver.phase == "RollingBack"
    decision = driver.policy.status.decision
    assert decision.reason == "Breach" and "while awaiting approval" in decision.message
    driver.tick()
    assert driver.phase == "RolledBack" and driver.world.deployments == {}


def test_a_pass_while_waiting_keeps_the_gate_true_and_asks_for_the_next_check() -> None:
    driver = awaiting_live()
    result = driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    assert driver.phase == "AwaitingApproval"
    assert driver.condition("LatencyGatePassed") == ("True", "AnalysisPassed")
    assert result.requeue_after == 60, "the next background check, not the idle poll"
    assert driver.policy.status.latency.passes == 2


def test_an_unapproved_rollout_rolls_back_at_its_approval_timeout() -> None:
    driver = Driver(
        make_policy(**{"gates.accuracy.enabled": False, "rollout.traffic": "Synthetic", "rollout.approval": "Manual"})
    )
    driver.edit({"rollout.approvalTimeoutSeconds": 600})  # a control field: the rollout goes on
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "AwaitingApproval"
    deadline = phase_deadline(driver.policy)
    assert deadline == driver.now + timedelta(seconds=600), "KVPolicyRolloutStuck fires only if this is missed"
    result = driver.tick(599)
    assert driver.phase == "AwaitingApproval" and "rolls back at" in driver.policy.status.message
    assert result.requeue_after <= 300
    driver.tick(2)
    assert driver.phase == "RollingBack"
    assert driver.policy.status.decision.reason == "ApprovalTimedOut"
    driver.tick()
    assert driver.phase == "RolledBack"
    assert driver.world.target_patches == 0, "an unapproved change never reaches the target"


def test_changing_the_approval_timeout_does_not_restart_the_rollout() -> None:
    spec = make_policy(**MANUAL).spec
    longer = make_policy(**MANUAL, **{"rollout.approvalTimeoutSeconds": 3600}).spec
    assert rollout_hash(spec) == rollout_hash(longer)


def test_a_late_approval_waits_for_a_fresh_passing_check() -> None:
    driver = awaiting_live()
    driver.tick(400)  # no check was made since (the metrics source is down): the evidence is 401 s old then
    approve(driver)
    driver.tick()
    assert driver.phase == "AwaitingApproval", "an approval does not promote on stale evidence"
    assert driver.reasons().count("ApprovalAwaitsAnalysis") == 1
    assert "401 s old" in driver.policy.status.message
    driver.tick(5)
    assert driver.reasons().count("ApprovalAwaitsAnalysis") == 1, "said once per wait"
    driver.tick(1, latency_verdict=verdict(GateVerdict.PASS))
    assert driver.phase == "Promoting"
    assert "Approved" in driver.reasons()


def test_an_approval_after_a_breach_waits_for_a_pass() -> None:
    driver = awaiting_live()
    driver.tick(60, latency_verdict=verdict(GateVerdict.BREACH))
    approve(driver)
    driver.tick()
    assert driver.phase == "AwaitingApproval"
    assert "was Breach" in driver.policy.status.message
    driver.tick(59, latency_verdict=verdict(GateVerdict.PASS))
    assert driver.phase == "Promoting"


def test_an_approval_on_a_fresh_pass_promotes_at_once() -> None:
    driver = awaiting_live()
    driver.tick(30)
    approve(driver)
    driver.tick()
    assert driver.phase == "Promoting"


@pytest.mark.parametrize("verdict_kind", [GateVerdict.NO_DATA, GateVerdict.PROVIDER_UNAVAILABLE])
def test_evidence_is_stale_after_an_inconclusive_check(verdict_kind: GateVerdict) -> None:
    driver = awaiting_live()
    driver.tick(60, latency_verdict=verdict(verdict_kind))
    stale = stale_evidence(driver.policy.spec, driver.policy.status, driver.now)
    assert stale is not None and verdict_kind.value in stale


def test_synthetic_evidence_does_not_age_the_canary_serves_no_users() -> None:
    driver = Driver(make_policy(**{"gates.accuracy.enabled": False, "rollout.traffic": "Synthetic", **MANUAL}))
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "AwaitingApproval"
    assert not latency_check_due(driver.policy, driver.now + timedelta(hours=1))
    driver.tick(3000)
    approve(driver)
    driver.tick()
    assert driver.phase == "Promoting"


def test_the_approval_timeout_must_leave_room_for_two_checks() -> None:
    with pytest.raises(ValidationError, match="approvalTimeoutSeconds must be at least twice"):
        KVPolicy.model_validate(
            {
                "metadata": {"name": "p"},
                "spec": policy_spec(**{"rollout.approvalTimeoutSeconds": 100, "gates.latency.intervalSeconds": 60}),
            }
        )
