"""End-to-end rollouts of a KServe LLMInferenceService target: the upstream CRD installed in the dev cluster,
KServe's controller's stand-in making each service's workload (simulated vLLM, run as KServe's preset runs it) and
its routing group's status, the operator under kopf, real gate Jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import (
    MODEL,
    MODEL_LEN,
    PATCHED_IMAGE,
    TARGET_IMAGE,
    Obj,
    OperatorFactory,
    decisions_counted,
    event_reasons,
    gate_jobs,
    policy,
    ready_pods,
    served_as_planned,
    tiny_model_policy,
    wait_decided,
    wait_decided_on_real_vllm,
    wait_phase,
    wait_until,
)
from kvpolicy_dev.devcluster import POOL_LABEL, ThreadedDevCluster
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner
from kvpolicy_dev.devcluster.kserve import crd

ISVC = ("serving.kserve.io/v1alpha2", "LLMInferenceService")
ISVC_REF = {"targetRef.kind": "LLMInferenceService", "targetRef.apiVersion": "serving.kserve.io/v1alpha2"}
WORKLOAD = "app.kubernetes.io/name=llama,app.kubernetes.io/component=llminferenceservice-workload"
FP8 = "--kv-cache-dtype fp8 --attention-backend FLASH_ATTN"


@pytest.fixture(scope="session")
def llminferenceservice_crd(devcluster: ThreadedDevCluster) -> None:
    devcluster.apply(crd())


pytestmark = pytest.mark.usefixtures("llminferenceservice_crd")


def isvc_target(namespace: str, max_model_len: int = MODEL_LEN, model: str = MODEL) -> Obj:
    """A one-replica service in routing group `llama`, its vLLM flags in VLLM_ADDITIONAL_ARGS."""
    main = {"name": "main", "image": TARGET_IMAGE,
            "env": [{"name": "VLLM_ADDITIONAL_ARGS", "value": f"--max-model-len {max_model_len}"}]}  # fmt: skip
    return {
        "apiVersion": ISVC[0],
        "kind": ISVC[1],
        "metadata": {"name": "llama", "namespace": namespace},
        "spec": {
            "model": {"uri": f"hf://example/{model}", "name": model},
            "replicas": 1,
            "template": {"nodeSelector": {POOL_LABEL: "h200"}, "containers": [main]},
            "router": {"route": {"group": "llama", "weight": 100}},
        },
    }


def additional_args(isvc: Obj) -> str:
    env = isvc["spec"]["template"]["containers"][0]["env"]
    return str(next(item["value"] for item in env if item["name"] == "VLLM_ADDITIONAL_ARGS"))


def rollout(devcluster: ThreadedDevCluster, ns: str, **overrides: object) -> None:
    devcluster.create(isvc_target(ns))
    devcluster.create(policy(ns, **ISVC_REF, **overrides))


def canaries(devcluster: ThreadedDevCluster, ns: str) -> list[Obj]:
    return devcluster.list(*ISVC, ns, "kvpolicy.dev/role=canary")


def test_an_llminferenceservice_is_promoted_through_its_routing_group(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    with operator():
        rollout(devcluster, ns)
        wait_phase(devcluster, ns, {"LatencyAnalysis", "Promoting", "Promoted"})
        done = wait_decided(devcluster, ns)
        # Counted after the status is written: looked for while the operator still runs.
        wait_until(lambda: decisions_counted(ns, "Promoted", "GatesPassed") == 1, "the decision metric")
    status = done["status"]
    assert status["phase"] == "Promoted", status
    promoted = devcluster.get(*ISVC, "llama", ns)
    assert additional_args(promoted) == f"--max-model-len {MODEL_LEN} {FP8}"
    assert promoted["spec"]["template"]["containers"][0]["image"] == PATCHED_IMAGE
    members = {m["name"]: m["weight"] for m in promoted["status"]["router"]["group"]["members"]}
    assert members == {"llama": 100}, "the canary left the group"

    def serving_fp8() -> bool:
        pods = ready_pods(devcluster, ns, WORKLOAD)
        return bool(pods) and all(" ".join(pod["spec"]["containers"][0]["args"]).endswith(FP8) for pod in pods)

    wait_until(serving_fp8, "the target's pods to run the FP8 configuration")
    assert canaries(devcluster, ns) == []
    reasons = event_reasons(devcluster, ns)
    for reason in ("Planned", "CanaryReady", "AccuracyGatePassed", "TrafficJoined", "Promoting", "Promoted"):
        assert reason in reasons


def test_an_llminferenceservice_whose_canary_fails_the_accuracy_gate_keeps_its_configuration(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    target = isvc_target(ns, max_model_len=131072)
    devcluster.create(target)
    with operator():
        devcluster.create(policy(ns, **ISVC_REF, **{"model.maxModelLen": 131072, "workload.maxContextTokens": 131072}))
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "RolledBack", done["status"]
    assert done["status"]["decision"]["reason"] == "AccuracyRecoveryBelowMinimum"
    after = devcluster.get(*ISVC, "llama", ns)
    assert additional_args(after) == additional_args(target)
    assert after["spec"]["template"]["containers"][0]["image"] == TARGET_IMAGE
    assert canaries(devcluster, ns) == []


def test_an_operator_restarted_mid_gate_resumes_the_llminferenceservice_rollout(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    with operator():
        rollout(devcluster, ns)
        wait_phase(devcluster, ns, {"AccuracyGate"})
        (job,) = wait_until(lambda: gate_jobs(devcluster, ns), "the accuracy gate Job")
    assert [c["metadata"]["name"] for c in canaries(devcluster, ns)] == ["llama-fp8-canary-g1"]
    with operator():
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert [j["metadata"]["uid"] for j in gate_jobs(devcluster, ns)] == [job["metadata"]["uid"]], "no second Job"
    assert event_reasons(devcluster, ns).count("Planned") == 1


def test_an_llminferenceservice_edited_mid_rollout_is_gated_again(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    with operator():
        rollout(devcluster, ns)
        wait_phase(devcluster, ns, {"AccuracyGate"})
        edited = devcluster.get(*ISVC, "llama", ns)["spec"]["template"]
        edited["containers"][0]["env"].append({"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"})
        devcluster.patch(*ISVC, "llama", {"spec": {"template": edited}}, ns)
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert "TargetChanged" in event_reasons(devcluster, ns)
    assert devcluster.find(*ISVC, "llama-fp8-canary-g1", ns) is None
    env = devcluster.get(*ISVC, "llama", ns)["spec"]["template"]["containers"][0]["env"]
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in env


@pytest.mark.realvllm
def test_an_llminferenceservice_of_real_vllm_servers_is_promoted_on_what_its_canary_serves(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, cpu_vllm_model: Path
) -> None:
    """Real vLLM (CPU build, a tiny random-weight Llama) runs each workload pod with the arguments KServe's preset
    gives `vllm serve`, VLLM_ADDITIONAL_ARGS included; the canary configuration check reads what the canary serves."""
    ns = devcluster_namespace
    devcluster.set_runner(RealVllmRunner(cpu_vllm_model))
    devcluster.create(isvc_target(ns, max_model_len=4096, model="tiny"))
    with operator():
        devcluster.create(tiny_model_policy(ns, **ISVC_REF))
        done = wait_decided_on_real_vllm(devcluster, ns)
    assert done["status"]["phase"] == "Promoted", done["status"]
    served_as_planned(done["status"])
    assert "TrafficJoined" in event_reasons(devcluster, ns), "it joined the routing group (weight 1)"
