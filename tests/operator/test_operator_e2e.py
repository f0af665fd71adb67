"""End-to-end rollouts: the operator under kopf against the dev cluster, simulated vLLM pods and real gate Jobs."""

from __future__ import annotations

from e2e_helpers import (
    KVP,
    PATCHED_IMAGE,
    TARGET_IMAGE,
    OperatorFactory,
    container,
    event_reasons,
    gate_jobs,
    policy,
    ready_pods,
    start_and_reach_the_gate,
    target,
    wait_decided,
    wait_phase,
    wait_until,
)
from kvpolicy_dev.devcluster import ThreadedDevCluster


def test_hopper_with_the_fixed_image_is_promoted(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns))
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted", done["status"]
    deployed = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert deployed["image"] == PATCHED_IMAGE
    assert deployed["args"][-4:] == ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]

    def serving_fp8() -> bool:
        pods = ready_pods(devcluster, ns, "app=llama")
        return bool(pods) and all(container(pod)["args"] == deployed["args"] for pod in pods)

    wait_until(serving_fp8, "the target's pods to run the FP8 configuration")
    accuracy = done["status"]["accuracy"]
    assert accuracy["verdict"] == "Pass" and accuracy["recovery"] >= 0.95
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []
    reasons = event_reasons(devcluster, ns)
    for reason in ("Planned", "CanaryReady", "AccuracyGatePassed", "TrafficJoined", "Promoting", "Promoted"):
        assert reason in reasons
    assert {c["type"]: c["status"] for c in done["status"]["conditions"]}["Promoted"] == "True"


def test_hopper_with_an_unfixed_image_is_rolled_back_at_128k(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns, max_model_len=131072))
    long_context = {"model.maxModelLen": 131072, "workload.maxContextTokens": 131072}
    with operator():
        devcluster.create(policy(ns, **long_context))
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    assert status["decision"]["reason"] == "AccuracyRecoveryBelowMinimum"
    assert "accuracy recovery" in status["decision"]["message"]
    deployed = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert deployed["image"] == TARGET_IMAGE and "--kv-cache-dtype" not in deployed["args"]
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []
    assert "AccuracyGateFailed" in event_reasons(devcluster, ns)


def test_blackwell_is_promoted_without_the_patched_image(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns, pool="b200"))
    with operator():
        devcluster.create(policy(ns))
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert done["status"]["gpu"]["generation"] == "Blackwell"
    deployed = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert deployed["image"] == TARGET_IMAGE
    assert deployed["args"][-4:] == ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASHINFER"]


def test_short_context_holds_bf16_without_a_canary(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, **{"workload.maxContextTokens": 4096, "workload.typicalContextTokens": 2048}))
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "HeldBF16"
    assert done["status"]["decision"]["reason"] == "BelowDecodeBreakEven"
    assert devcluster.list("apps/v1", "Deployment", ns) == [devcluster.get("apps/v1", "Deployment", "llama", ns)]
    assert devcluster.list("batch/v1", "Job", ns) == []
    assert container(devcluster.get("apps/v1", "Deployment", "llama", ns))["image"] == TARGET_IMAGE


def test_canary_without_gpu_capacity_rolls_back_at_the_deadline(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.set_pool_capacity("h200", 1)  # the target's pod takes the only slot
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, **{"rollout.progressDeadlineSeconds": 3}))
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "RolledBack"
    assert status["decision"]["reason"] == "CapacityUnavailable"
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["CapacityAvailable"] == ("False", "Unschedulable")
    assert conditions["CanaryReady"] == ("False", "CapacityUnavailable")
    assert "CanaryUnschedulable" in event_reasons(devcluster, ns)
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []


def test_operator_restarted_mid_gate_resumes_without_a_duplicate_job(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        start_and_reach_the_gate(devcluster, ns)
        (job,) = wait_until(lambda: gate_jobs(devcluster, ns), "the accuracy gate Job")
    with operator():
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted"
    assert [j["metadata"]["uid"] for j in gate_jobs(devcluster, ns)] == [job["metadata"]["uid"]]
    assert event_reasons(devcluster, ns).count("Planned") == 1


def test_spec_edit_mid_rollout_restarts_the_analysis(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        start_and_reach_the_gate(devcluster, ns)
        devcluster.patch(*KVP, "llama-fp8", {"spec": {"gates": {"accuracy": {"minRecovery": "0.96"}}}}, ns)
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "Promoted" and status["rolloutGeneration"] == 2
    assert status["accuracy"]["job"] == "llama-fp8-accuracy-g2"
    assert "AnalysisRestarted" in event_reasons(devcluster, ns)
    assert devcluster.find("apps/v1", "Deployment", "llama-fp8-canary-g1", ns) is None


def test_abort_rolls_back(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        start_and_reach_the_gate(devcluster, ns)
        devcluster.patch(*KVP, "llama-fp8", {"spec": {"rollout": {"abort": True}}}, ns)
        done = wait_phase(devcluster, ns, {"RolledBack", "Promoted"})
    assert done["status"]["decision"]["reason"] == "Aborted"
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []
    assert container(devcluster.get("apps/v1", "Deployment", "llama", ns))["image"] == TARGET_IMAGE


def test_deleting_the_policy_removes_its_children_and_keeps_the_target(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        start_and_reach_the_gate(devcluster, ns)
        devcluster.delete(*KVP, "llama-fp8", ns)
        devcluster.wait_deleted(*KVP, "llama-fp8", ns, give_up_after=30)
    selector = "kvpolicy.dev/policy=llama-fp8"
    for api_version, kind in (("apps/v1", "Deployment"), ("v1", "Service"), ("batch/v1", "Job")):
        assert devcluster.list(api_version, kind, ns, selector) == [], kind
    assert container(devcluster.get("apps/v1", "Deployment", "llama", ns))["image"] == TARGET_IMAGE
    messages = [e["message"] for e in devcluster.list("v1", "Event", ns) if e["reason"] == "Deleted"]
    assert messages and "BF16 KV cache" in messages[0]


def test_api_conflicts_and_server_errors_are_retried(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    status_faults = devcluster.fail_next(3, 500, method="PATCH", resource="kvpolicies", subresource="status")
    create_faults = devcluster.fail_next(2, 409, method="POST", resource="deployments", namespace=ns)
    with operator():
        devcluster.create(policy(ns))
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted"
    assert status_faults.hits == 3 and create_faults.hits == 2
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == []
