"""Replicas of `kvpolicy run` with leader election on the dev cluster: the leader is killed mid-rollout, later the next
leader loses the API for its Lease while its other requests still work (the split brain of argo-rollouts#2117), and a
leader killed in Promoting. Each time the standby takes over and carries the rollout on to its promotion, and the API
server's write log shows one actor at a time, the cut-off leader stopping before its successor starts. The seconds
each takeover took are printed, not asserted (the machine's load decides them; the elector's timing is tested under
fake time in tests/kube/test_kube_leader.py)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from pathlib import Path

from e2e_helpers import KVP, policy, target, wait_decided, wait_phase, wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster, WriteRecord
from operator_process import OperatorProcess, operator_process

LEASE = "kvpolicy-operator-leader"


def holder(cluster: ThreadedDevCluster, namespace: str) -> str | None:
    lease = cluster.find("coordination.k8s.io/v1", "Lease", LEASE, namespace)
    return (lease or {}).get("spec", {}).get("holderIdentity")


def role(operator: OperatorProcess) -> str | None:
    health = operator.healthz()
    return health[1]["operator"]["role"] if health else None


def acquired(writes: list[WriteRecord], user: str, after: float) -> float:
    """When `user` first wrote the Lease successfully after `after`: its acquisition."""
    return next(w.time for w in writes if w.user == user and w.resource == "leases" and w.code < 300 and w.time > after)


def test_a_standby_takes_over_mid_rollout_and_the_two_never_act_at_once(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    kvpolicy_crd: None,
    fixed_image_runner: None,
    tmp_path: Path,
) -> None:
    ns = devcluster_namespace
    election = {"KVPOLICY_LEADER_ELECTION_LEASE": LEASE, "KVPOLICY_LEADER_ELECTION_NAMESPACE": ns}

    def replica(name: str) -> AbstractContextManager[OperatorProcess]:
        return operator_process(devcluster, tmp_path, name, "-n", ns, env={**election, "KVPOLICY_POD_NAME": name})

    devcluster.create(target(ns))
    log_start = len(devcluster.writes())
    began = time.time()
    with replica("a") as a, replica("b") as b:
        wait_until(lambda: holder(devcluster, ns) in ("a", "b"), "a replica to take the Lease")
        if holder(devcluster, ns) == "b":  # whichever came first leads; name them so that a leads
            a, b = b, a
        assert role(a) == "leader" and role(b) == "standby"
        assert (a.metric("kvpolicy_leader"), b.metric("kvpolicy_leader")) == (1.0, 0.0)
        devcluster.create(policy(ns, **{"rollout.approval": "Manual"}))  # holds before promoting
        wait_phase(devcluster, ns, {"AccuracyGate"})

        a.kill()  # mid-rollout, nothing released: b takes over and carries the rollout on
        killed_at = time.time()
        wait_until(lambda: holder(devcluster, ns) == b.name, "the standby to take the Lease", timeout=40)
        wait_phase(devcluster, ns, {"AwaitingApproval"})

        with replica("c") as c:  # the killed pod's replacement: a standby
            assert role(c) == "standby"
            assert b.metric("kvpolicy_policy_info") == 1.0, "the leader exports the policy's series"
            assert c.metric("kvpolicy_policy_info") is None
            # b can no longer renew its Lease but reaches everything else (argo-rollouts#2117), and has work to do.
            cut_off = devcluster.outage(503, user=b.name, resource="leases")
            cut_at = time.time()
            devcluster.patch(*KVP, "llama-fp8", {"spec": {"gates": {"accuracy": {"maxSamples": 41}}}}, ns)
            wait_until(lambda: holder(devcluster, ns) == "c", "c to take the Lease", timeout=40)
            wait_until(lambda: role(b) == "standby", "b to stand by")
            assert b.running() and b.metric("kvpolicy_leader") == 0.0
            # A standby exports no per-policy series: a stale phase deadline would fire KVPolicyRolloutStuck.
            for series in ("kvpolicy_policy_info", "kvpolicy_policy_phase_deadline_timestamp_seconds"):
                wait_until(lambda series=series: b.metric(series) is None, f"b to drop {series}")
            devcluster.end_fault(cut_off)
            awaiting = wait_phase(devcluster, ns, {"AwaitingApproval"})
            approval = {"approvedRollout": awaiting["status"]["rolloutId"]}  # an approval names the rollout
            devcluster.patch(*KVP, "llama-fp8", {"spec": {"rollout": approval}}, ns)
            done = wait_decided(devcluster, ns)
            assert role(c) == "leader" and role(b) == "standby"
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert done["status"]["rolloutGeneration"] == 2, "the rollout the edit restarted"

    writes = [w for w in devcluster.writes()[log_start:] if w.time >= began]
    acts = [w for w in writes if w.resource != "leases"]
    b_leads, c_leads = acquired(writes, b.name, killed_at), acquired(writes, "c", cut_at)
    terms = {a.name: (began, killed_at), b.name: (b_leads, c_leads), "c": (c_leads, time.time())}
    for user, (start, end) in terms.items():
        own = [w.time for w in acts if w.user == user]
        assert own and all(start <= moment <= end for moment in own), f"{user} wrote outside its term"
    b_last = max(w.time for w in acts if w.user == b.name)
    assert b_last > cut_at, "b acted after losing its renewals (the edit)"
    # b's fence closed 7 s after its last renewal; c may take over 10 s after it: b stopped before.
    assert b_last < c_leads, f"b wrote {b_last - c_leads:.1f} s after c led"
    print(f"takeovers: {b_leads - killed_at:.1f} s after the kill, {c_leads - cut_at:.1f} s after the cut; b's last "
          f"write {c_leads - b_last:.1f} s before c led")  # fmt: skip


def test_a_leader_killed_in_promotion_is_replaced_and_the_standby_decides_at_once(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    kvpolicy_crd: None,
    fixed_image_runner: None,
    tmp_path: Path,
) -> None:
    """The issue's case: the leader dies while the promoted target's pods start; the standby takes the Lease, its
    first pass finds them ready and decides, without waiting out a requeue period first."""
    ns = devcluster_namespace
    election = {"KVPOLICY_LEADER_ELECTION_LEASE": LEASE, "KVPOLICY_LEADER_ELECTION_NAMESPACE": ns}

    def replica(name: str) -> AbstractContextManager[OperatorProcess]:
        return operator_process(devcluster, tmp_path, name, "-n", ns, env={**election, "KVPOLICY_POD_NAME": name})

    devcluster.create(target(ns))
    log_start = len(devcluster.writes())
    with replica("a") as a:
        wait_until(lambda: holder(devcluster, ns) == "a", "a to take the Lease")
        with replica("b") as b:
            wait_until(lambda: role(b) == "standby", "b to stand by")
            devcluster.create(policy(ns, **{"rollout.approval": "Manual", "rollout.progressDeadlineSeconds": 600}))
            awaiting = wait_phase(devcluster, ns, {"AwaitingApproval"})
            devcluster.set_pool_capacity("h200", 0)  # the promoted target's new pods stay Pending: Promoting lasts
            approval = {"approvedRollout": awaiting["status"]["rolloutId"]}
            devcluster.patch(*KVP, "llama-fp8", {"spec": {"rollout": approval}}, ns)
            wait_phase(devcluster, ns, {"Promoting"})
            a.kill()
            killed_at = time.time()
            devcluster.set_pool_capacity("h200", None)  # the new pods start while nobody leads
            wait_until(lambda: holder(devcluster, ns) == "b", "the standby to take the Lease", timeout=60)
            done = wait_decided(devcluster, ns)
            done_at = time.time()
            assert role(b) == "leader"
    assert done["status"]["phase"] == "Promoted", done["status"]

    writes = [w for w in devcluster.writes()[log_start:]]
    acts = [w for w in writes if w.resource != "leases" and w.code < 300]
    b_leads = acquired(writes, "b", killed_at)
    assert all(w.time <= killed_at for w in acts if w.user == "a"), "a wrote after it was killed"
    assert all(w.time >= b_leads for w in acts if w.user == "b"), "b wrote before it held the Lease"
    decision = [w for w in acts if w.user == "b" and w.resource == "kvpolicies" and w.path.subresource == "status"]
    assert decision, "b wrote the decision"
    print(f"leader killed in Promoting; seconds after the kill: b held the Lease {b_leads - killed_at:.1f}, wrote the "
          f"status {decision[0].time - killed_at:.1f}, Promoted seen {done_at - killed_at:.1f}")  # fmt: skip
