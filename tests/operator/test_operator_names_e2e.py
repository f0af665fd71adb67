"""Policy names with dots, digits and up to 253 characters roll out on the emulated cluster, whose API server refuses
names and label values as kube-apiserver does."""

from __future__ import annotations

import pytest
from e2e_helpers import KVP, PATCHED_IMAGE, OperatorFactory, container, policy, target, wait_phase
from kvpolicy.rollout import builders as b
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster

LONG_NAME = ".".join(["llama-3" + "1" * 56, "8b-instruct" + "x" * 52, "fp8" + "k" * 60])[:200]


@pytest.mark.parametrize("name", ["llama-3.1-8b", LONG_NAME], ids=["dotted", "200-characters"])
def test_any_legal_policy_name_rolls_out(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, name: str
) -> None:
    assert len(name) <= 253
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, name=name))
        done = wait_phase(devcluster, ns, {"Promoted", "RolledBack", "HeldBF16"}, name=name)
        devcluster.delete(*KVP, name, ns)
        devcluster.wait_deleted(*KVP, name, ns, give_up_after=30)
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert done["status"]["accuracy"]["job"] == b.job_name(name, "accuracy", 1)
    assert container(devcluster.get("apps/v1", "Deployment", "llama", ns))["image"] == PATCHED_IMAGE
    selector = f"{b.POLICY_LABEL}={b.policy_labels(name)[b.POLICY_LABEL]}"
    assert devcluster.list("apps/v1", "Deployment", ns, selector) == [], "the canary is gone"
    deleted = [e for e in devcluster.list("v1", "Event", ns) if e["reason"] == "Deleted"]
    assert deleted and deleted[0]["involvedObject"]["name"] == name, "events of any policy name are accepted"
