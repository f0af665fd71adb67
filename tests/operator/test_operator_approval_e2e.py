"""A rollout waiting for its Manual approval on the emulated cluster (issue 23 item 5): a ReplicaRatio canary that
serves the users while it waits stays under the latency analysis (here: the users stop, the checks find no data, and
onInconclusive Rollback rolls it back), and an unapproved rollout rolls back at rollout.approvalTimeoutSeconds."""

from __future__ import annotations

import pytest
from e2e_helpers import (
    KVP,
    PATCHED_IMAGE,
    OperatorFactory,
    container,
    event_reasons,
    policy,
    target,
    users,
    wait_decided,
    wait_phase,
)
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster


def simulated_target(devcluster: ThreadedDevCluster, ns: str) -> None:
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))
    devcluster.create(target(ns))


def test_a_canary_serving_users_while_it_waits_for_approval_is_still_analysed(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    simulated_target(devcluster, ns)
    latency = {
        "enabled": True,
        "provider": "Scrape",
        "ttftMaxRatio": "100",
        "itlMaxRatio": "100",
        "windowSeconds": 10,
        "intervalSeconds": 1,
        "minRequests": 3,
        "onInconclusive": "Rollback",
        "inconclusiveDeadlineSeconds": 5,
    }
    manual = policy(
        ns,
        **{"gates.accuracy.enabled": False, "gates.latency": latency, "rollout.bakeSeconds": 3},
        **{"rollout.approval": "Manual"},
    )
    with operator():
        with users(devcluster, ns):
            devcluster.create(manual)
            wait_phase(devcluster, ns, {"AwaitingApproval"})
        # The users stop: every check now finds too few requests, and past the stall deadline the waiting canary is
        # rolled back instead of waiting, unwatched, for an approval that would promote it.
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    assert status["decision"]["reason"] == "AnalysisStalled"
    assert "while awaiting approval" in status["decision"]["message"]
    assert "AwaitingApproval" in event_reasons(devcluster, ns)
    assert container(devcluster.get("apps/v1", "Deployment", "llama", ns))["image"] != PATCHED_IMAGE


def test_an_unapproved_rollout_rolls_back_at_its_approval_timeout(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    simulated_target(devcluster, ns)
    waits = {
        "gates.accuracy.enabled": False,
        "gates.latency.intervalSeconds": 1,
        "rollout.traffic": "Synthetic",
        "rollout.approval": "Manual",
        "rollout.approvalTimeoutSeconds": 3,
    }
    with operator():
        devcluster.create(policy(ns, **waits))
        wait_phase(devcluster, ns, {"AwaitingApproval"})
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    assert status["decision"]["reason"] == "ApprovalTimedOut"
    assert devcluster.find("apps/v1", "Deployment", status["canary"]["deployment"], ns) is None


def test_an_approval_timeout_too_short_for_two_checks_is_refused_at_admission(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    short = policy(ns, **{"gates.latency.intervalSeconds": 60, "rollout.approvalTimeoutSeconds": 90})
    with pytest.raises(Exception, match="approvalTimeoutSeconds must be at least twice") as refused:
        devcluster.create(short)
    assert "90 < 2 * 60" in str(refused.value)
    assert devcluster.find(*KVP, "llama-fp8", ns) is None
