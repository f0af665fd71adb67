"""End-to-end rollouts of a KServe LLMInferenceService target: the upstream CRDs installed in the dev cluster
(KServe's, the Gateway API's, LeaderWorkerSet's), KServe's controller's stand-in making each service's workloads
(simulated vLLM, run as KServe's presets run it), its HTTPRoute with the routing group's weights and the group's status,
the operator under kopf (or as a process, SIGKILLed), real gate Jobs."""

from __future__ import annotations

import signal
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
from kvpolicy_dev.devcluster import POOL_LABEL, ThreadedDevCluster, leaderworkerset
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner
from kvpolicy_dev.devcluster.kserve import crd, route_name, service_name
from operator_process import operator_process

ISVC = ("serving.kserve.io/v1alpha2", "LLMInferenceService")
ISVC_REF = {"targetRef.kind": "LLMInferenceService", "targetRef.apiVersion": "serving.kserve.io/v1alpha2"}
WORKLOAD = "app.kubernetes.io/name=llama,app.kubernetes.io/part-of=llminferenceservice"  # every vLLM pod of it
FP8 = "--kv-cache-dtype fp8 --attention-backend FLASH_ATTN"


@pytest.fixture(scope="session")
def llminferenceservice_crd(devcluster: ThreadedDevCluster, gateway_api: None) -> None:
    """KServe routes a group through HTTPRoutes (no Gateway API CRDs: no route, no group) and runs a multi-node
    service as a LeaderWorkerSet."""
    devcluster.apply(crd())
    devcluster.apply(leaderworkerset.crd())


pytestmark = pytest.mark.usefixtures("llminferenceservice_crd")


def isvc_target(namespace: str, max_model_len: int = MODEL_LEN, model: str = MODEL, disaggregated: bool = False) -> Obj:
    """A one-replica service in routing group `llama` at weight 100, its vLLM flags in VLLM_ADDITIONAL_ARGS;
    `disaggregated`: multi-node (a worker per leader, pipeline parallel 2) with a prefill Deployment of its own, whose
    pod specs name no vLLM container (KServe's presets give them `main`)."""
    main = {"name": "main", "image": TARGET_IMAGE,
            "env": [{"name": "VLLM_ADDITIONAL_ARGS", "value": f"--max-model-len {max_model_len}"}]}  # fmt: skip
    spec: Obj = {
        "model": {"uri": f"hf://example/{model}", "name": model},
        "replicas": 1,
        "template": {"nodeSelector": {POOL_LABEL: "h200"}, "containers": [main]},
        "router": {"route": {"group": "llama", "weight": 100}},
    }
    if disaggregated:
        spec["parallelism"] = {"pipeline": 2}
        spec["worker"] = {"nodeSelector": {POOL_LABEL: "h200"}, "containers": [{**main, "env": list(main["env"])}]}
        spec["prefill"] = {"replicas": 1, "template": {"nodeSelector": {POOL_LABEL: "h200"}}}
    return {"apiVersion": ISVC[0], "kind": ISVC[1], "metadata": {"name": "llama", "namespace": namespace}, "spec": spec}


def additional_args(obj: Obj) -> str:
    """VLLM_ADDITIONAL_ARGS of the `main` container of a service's template, or of a pod spec of it."""
    pod = obj["spec"]["template"] if obj.get("kind") == ISVC[1] else obj
    env = next(c for c in pod["containers"] if c["name"] == "main")["env"]
    return str(next(item["value"] for item in env if item["name"] == "VLLM_ADDITIONAL_ARGS"))


def rollout(devcluster: ThreadedDevCluster, ns: str, disaggregated: bool = False, **overrides: object) -> None:
    devcluster.create(isvc_target(ns, disaggregated=disaggregated))
    devcluster.create(policy(ns, **ISVC_REF, **overrides))


def canaries(devcluster: ThreadedDevCluster, ns: str) -> list[Obj]:
    return devcluster.list(*ISVC, ns, "kvpolicy.dev/role=canary")


def test_a_multi_node_disaggregated_llminferenceservice_is_stepped_up_its_routing_group_and_promoted(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    """Leader, worker and prefill pods all get the KV flags; the canary enters the group at weight 1, then 12 (10 %
    beside 100) and 100 (50 %), each step counted once the group's status, written by KServe's stand-in after the
    HTTPRoute it made, lists that weight; promoted, the canary is kept stopped, out of the route."""
    ns = devcluster_namespace
    canary = "llama-fp8-canary-g1"
    with operator():
        rollout(devcluster, ns, disaggregated=True)
        done = wait_decided(devcluster, ns)
        # Counted after the status is written: looked for while the operator still runs.
        wait_until(lambda: decisions_counted(ns, "Promoted", "GatesPassed") == 1, "the decision metric")
    status = done["status"]
    assert status["phase"] == "Promoted", status
    shifted = [e["message"] for e in devcluster.list("v1", "Event", ns) if e.get("reason") == "TrafficShifted"]
    weights = sorted(int(m.split(":")[0].rsplit(" ", 1)[1]) for m in shifted)
    assert weights == [12, 100], shifted
    promoted = devcluster.get(*ISVC, "llama", ns)
    for pod_spec in (promoted["spec"]["template"], promoted["spec"]["worker"], promoted["spec"]["prefill"]["template"]):
        assert additional_args(pod_spec).endswith(FP8), pod_spec
    assert promoted["spec"]["template"]["containers"][0]["image"] == PATCHED_IMAGE
    members = {
        m["name"]: (m["weight"], m.get("stopped", False)) for m in promoted["status"]["router"]["group"]["members"]
    }
    assert members == {"llama": (100, False), canary: (0, True)}, "the canary stays, stopped, as a way back"
    assert status["retainedCanary"] == canary
    route = devcluster.get("gateway.networking.k8s.io/v1", "HTTPRoute", route_name("llama"), ns)
    publisher = next(r for r in route["spec"]["rules"] if r["name"] == "v1-chat-completions-publisher-path")
    assert [(ref["name"], ref["weight"]) for ref in publisher["backendRefs"]] == [(service_name("llama"), 100)]
    assert devcluster.find("gateway.networking.k8s.io/v1", "HTTPRoute", route_name(canary), ns) is None

    seen: list[tuple[str, bool]] = []

    def serving_fp8() -> bool:
        pods = ready_pods(devcluster, ns, WORKLOAD)
        seen[:] = [(p["metadata"]["labels"]["app.kubernetes.io/component"],
                    " ".join(p["spec"]["containers"][0]["args"]).endswith(FP8)) for p in pods]  # fmt: skip
        every = {f"llminferenceservice-workload-{c}" for c in ("leader", "worker", "prefill")}
        return {component for component, _ in seen} == every and all(fp8 for _, fp8 in seen)

    try:
        wait_until(serving_fp8, "the target's leader, worker and prefill pods to run the FP8 configuration")
    except AssertionError as error:
        raise AssertionError(f"{error}: ready pods (component, FP8): {seen}") from None
    assert ready_pods(devcluster, ns, "app.kubernetes.io/name=" + canary) == [], "the stopped canary's GPUs are free"
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
    assert canaries(devcluster, ns) == [], "a rolled back canary is deleted"


def test_an_operator_killed_mid_gate_resumes_the_llminferenceservice_rollout(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    fixed_image_runner: None,
    tmp_path: Path,
) -> None:
    """`kvpolicy run` as a process, SIGKILLed while the accuracy gate runs; another operator takes the rollout up."""
    ns = devcluster_namespace
    with operator_process(devcluster, tmp_path, "operator", "--namespace", ns) as killed:
        rollout(devcluster, ns)
        wait_phase(devcluster, ns, {"AccuracyGate"})
        (job,) = wait_until(lambda: gate_jobs(devcluster, ns), "the accuracy gate Job")
        killed.kill()
    assert killed.process.returncode == -signal.SIGKILL
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
    assert devcluster.find(*ISVC, "llama-fp8-canary-g1", ns) is None, "the first run's canary was deleted"
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
