"""Replicas of `kvpolicy run` with leader election on the dev cluster: the leader is killed mid-rollout, later the next
leader loses the API for its Lease while its other requests still work (the split brain of argo-rollouts#2117). Each
time the standby takes over within about 15 s and carries the rollout on to its promotion, and the API server's write
log shows one actor at a time, the cut-off leader stopping well before its successor starts."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from pathlib import Path

from e2e_helpers import KVP, policy, target, wait_decided, wait_phase, wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster, WriteRecord
from operator_process import OperatorProcess, operator_process

LEASE = "kvpolicy-operator-leader"
# client-go's timing (leader.LeaseTiming): a standby takes over 15 s after the last renewal it saw, +1 retry (2 s).
TAKEOVER_SECONDS = 15 + 2


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
    assert b_leads - killed_at <= TAKEOVER_SECONDS + 3, f"b took over {b_leads - killed_at:.1f} s after a was killed"
    assert c_leads - cut_at <= TAKEOVER_SECONDS + 3, f"c took over {c_leads - cut_at:.1f} s after b was cut off"
    terms = {a.name: (began, killed_at), b.name: (b_leads, c_leads), "c": (c_leads, time.time())}
    for user, (start, end) in terms.items():
        own = [w.time for w in acts if w.user == user]
        assert own and all(start <= moment <= end for moment in own), f"{user} wrote outside its term"
    b_last = max(w.time for w in acts if w.user == b.name)
    assert b_last > cut_at, "b acted after losing its renewals (the edit)"
    # b's fence closed 10 s after its last renewal; c may take over 15 s after it: b stopped well before.
    assert b_last < c_leads - 3, f"b's last write {c_leads - b_last:.1f} s before c led"
    print(f"takeovers: {b_leads - killed_at:.1f} s after the kill, {c_leads - cut_at:.1f} s after the cut; b's last "
          f"write {c_leads - b_last:.1f} s before c led")  # fmt: skip
