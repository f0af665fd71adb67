"""Credentials a policy references that are not there, through the operator under kopf on the dev cluster: each says
so in a condition with its own reason and one Warning event, and the rollout follows the rule it already had (the
progress deadline for a gate pod that cannot start, or for a served configuration that cannot be read)."""

from __future__ import annotations

from typing import Any

from e2e_helpers import KVP, OperatorFactory, event_reasons, policy, target, wait_decided, wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster


def condition(cluster: ThreadedDevCluster, namespace: str, type_: str) -> dict[str, Any]:
    status = cluster.get(*KVP, "llama-fp8", namespace).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def test_a_missing_api_key_secret_keeps_the_gate_pod_from_starting_and_fails_the_gate_at_the_deadline(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    key_ref = {"apiKeySecretRef": {"name": "vllm-api-key", "key": "token"}}
    with operator():
        devcluster.create(policy(ns, **{"vllmAuth": key_ref, "rollout.progressDeadlineSeconds": 8}))

        def said() -> str | None:
            gate = condition(devcluster, ns, "AccuracyGatePassed")
            return gate.get("message") if gate.get("reason") == "GatePodNotStarting" else None

        message = wait_until(said, "the gate's condition to say its pod cannot start")
        assert "CreateContainerConfigError" in message and "vllm-api-key/token not found" in message, message
        done = wait_decided(devcluster, ns)
    decision = done["status"]["decision"]
    assert (done["status"]["phase"], decision["reason"]) == ("RolledBack", "AccuracyGateError"), decision
    assert "GatePodNotStarting" in event_reasons(devcluster, ns)


def test_a_missing_prometheus_secret_is_said_by_its_reason_and_the_served_check_gives_up_at_the_deadline(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    latency = {
        "provider": "Prometheus",
        "prometheusURL": "https://prometheus.invalid:9091",
        "prometheusAuth": {"bearerTokenSecretRef": {"name": "prometheus-reader", "key": "token"}},
    }
    with operator():
        devcluster.create(policy(ns, **{"gates.latency": latency, "rollout.progressDeadlineSeconds": 8}))

        def said() -> dict[str, Any] | None:
            verified = condition(devcluster, ns, "CanaryConfigVerified")
            return verified if verified.get("reason") == "CredentialsSecretMissing" else None

        verified = wait_until(said, "CanaryConfigVerified to name the missing Secret")
        assert verified["status"] == "Unknown"
        assert verified["message"] == (
            f"waiting for the canary's vllm:cache_config_info: Secret {ns}/prometheus-reader not found"
        )
        done = wait_decided(devcluster, ns)
    decision = done["status"]["decision"]
    assert (done["status"]["phase"], decision["reason"]) == ("RolledBack", "ProgressDeadlineExceeded"), decision
    assert f"Secret {ns}/prometheus-reader not found" in decision["message"]
    assert event_reasons(devcluster, ns).count("CredentialsSecretMissing") == 1
