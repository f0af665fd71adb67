"""Gate Jobs on a hardened cluster: a namespace enforcing Pod Security "restricted" and a private registry; a gate image
that cannot be pulled fails the gate at the progress deadline with the kubelet's reason, not after the gate's hour."""

from __future__ import annotations

from typing import Any

from e2e_helpers import OperatorFactory, event_reasons, policy, target, wait_decided, wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.podsecurity import ENFORCE_LABEL

GATE_IMAGE = "kvpolicy-operator:test"  # the tests' KVPOLICY_GATE_IMAGE
PULL_SECRET = "registry-credentials"


def restricted_target(namespace: str) -> dict[str, Any]:
    deployment = target(namespace)
    pod = deployment["spec"]["template"]["spec"]
    pod["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
    pod["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    pod["imagePullSecrets"] = [{"name": PULL_SECRET}]
    return deployment


def test_a_rollout_in_a_restricted_namespace_pulls_its_gates_with_the_targets_secret(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.patch("v1", "Namespace", ns, {"metadata": {"labels": {ENFORCE_LABEL: "restricted"}}})
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": PULL_SECRET, "namespace": ns},
              "type": "kubernetes.io/dockerconfigjson", "data": {".dockerconfigjson": "e30="}}  # fmt: skip
    devcluster.create(secret)
    devcluster.set_private_registry(GATE_IMAGE, PULL_SECRET)
    devcluster.create(restricted_target(ns))
    with operator():
        devcluster.create(policy(ns))
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert done["status"]["accuracy"]["verdict"] == "Pass"


def test_an_unpullable_gate_image_is_said_at_once_and_fails_at_the_progress_deadline(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.set_private_registry(GATE_IMAGE, PULL_SECRET)  # the target names no pull Secret
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, **{"rollout.progressDeadlineSeconds": 8}))

        def said() -> str | None:
            status = devcluster.get("kvpolicy.dev/v1alpha1", "KVPolicy", "llama-fp8", ns).get("status") or {}
            gate = next((c for c in status.get("conditions") or [] if c["type"] == "AccuracyGatePassed"), {})
            return gate.get("message") if gate.get("reason") == "GatePodNotStarting" else None

        message = wait_until(said, "the gate's condition to say its pod cannot start")
        assert "ErrImagePull" in message or "ImagePullBackOff" in message
        done = wait_decided(devcluster, ns)
    decision = done["status"]["decision"]
    assert (done["status"]["phase"], decision["reason"]) == ("RolledBack", "AccuracyGateError")
    assert "not started in 8 s" in decision["message"] and "ImagePullBackOff" in decision["message"]
    assert "GatePodNotStarting" in event_reasons(devcluster, ns)
    assert (
        devcluster.list("batch/v1", "Job", ns) == []
        and devcluster.list("apps/v1", "Deployment", ns)[0]["metadata"]["name"] == "llama"
    )
