"""End-to-end rollouts of a LeaderWorkerSet target: the upstream CRD installed in the dev cluster, the LeaderWorkerSet
controller's stand-in making the leader and worker pods (simulated vLLM), the operator under kopf, real gate Jobs."""

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
from kvpolicy_dev.devcluster import POOL_LABEL, ThreadedDevCluster
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner
from kvpolicy_dev.devcluster.leaderworkerset import crd
from operator_process import operator_process

LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
LWS_REF = {"targetRef.kind": "LeaderWorkerSet", "targetRef.apiVersion": "leaderworkerset.x-k8s.io/v1"}
PARALLEL = ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2"]
LEADERS = "leaderworkerset.sigs.k8s.io/name=llama,leaderworkerset.sigs.k8s.io/worker-index=0"
WORKERS = "leaderworkerset.sigs.k8s.io/name=llama,leaderworkerset.sigs.k8s.io/worker-index=1"


@pytest.fixture(scope="session")
def leaderworkerset_crd(devcluster: ThreadedDevCluster) -> None:
    devcluster.apply(crd())


pytestmark = pytest.mark.usefixtures("leaderworkerset_crd")


def lws_target(namespace: str, max_model_len: int = MODEL_LEN, model: str = MODEL) -> Obj:
    """One group of two nodes: the leader serves the API, the worker runs `vllm serve --headless`."""

    def template(role: str, rank: str) -> Obj:
        args = [model, "--max-model-len", str(max_model_len), *PARALLEL, "--node-rank", rank]
        args += ["--master-addr", "$(LWS_LEADER_ADDRESS)", *(["--headless"] if role == "worker" else [])]
        vllm = {"name": "vllm", "image": TARGET_IMAGE, "command": ["vllm", "serve"], "args": args,
                "ports": [{"name": "http", "containerPort": 8000}]}  # fmt: skip
        return {"metadata": {"labels": {"app": "llama", "role": role}},
                "spec": {"nodeSelector": {POOL_LABEL: "h200"}, "containers": [vllm]}}  # fmt: skip

    return {
        "apiVersion": LWS[0],
        "kind": LWS[1],
        "metadata": {"name": "llama", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": 2,
                "leaderTemplate": template("leader", "0"),
                "workerTemplate": template("worker", "1"),
            },
        },
    }


def lws_policy(namespace: str, **overrides: object) -> Obj:
    return policy(namespace, **LWS_REF, **overrides)


def _args(lws: Obj, key: str) -> list[str]:
    args: list[str] = lws["spec"]["leaderWorkerTemplate"][key]["spec"]["containers"][0]["args"]
    return args


def _to_the_gate(devcluster: ThreadedDevCluster, ns: str) -> None:
    devcluster.create(lws_target(ns))
    devcluster.create(lws_policy(ns))
    wait_phase(devcluster, ns, {"AccuracyGate"})


def _canaries(devcluster: ThreadedDevCluster, ns: str) -> list[Obj]:
    return devcluster.list(*LWS, ns, "kvpolicy.dev/role=canary")


def test_a_leaderworkerset_is_promoted_leader_and_workers_together(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(lws_target(ns))
    wait_until(lambda: ready_pods(devcluster, ns, LEADERS) and ready_pods(devcluster, ns, WORKERS), "the target group")
    with operator():
        devcluster.create(lws_policy(ns))
        done = wait_decided(devcluster, ns)
        # Counted after the status is written: looked for while the operator still runs.
        wait_until(lambda: decisions_counted(ns, "Promoted", "GatesPassed") == 1, "the decision metric")
    status = done["status"]
    assert status["phase"] == "Promoted", status
    assert status["canary"]["parallelism"] == {"tensor": 8, "pipeline": 2, "data": 1}
    promoted = devcluster.get(*LWS, "llama", ns)
    fp8 = ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]
    for key in ("leaderTemplate", "workerTemplate"):
        assert _args(promoted, key)[-4:] == fp8, key
        assert promoted["spec"]["leaderWorkerTemplate"][key]["spec"]["containers"][0]["image"] == PATCHED_IMAGE

    def group_runs_fp8() -> bool:
        pods = [*ready_pods(devcluster, ns, LEADERS), *ready_pods(devcluster, ns, WORKERS)]
        return len(pods) == 2 and all(pod["spec"]["containers"][0]["args"][-4:] == fp8 for pod in pods)

    wait_until(group_runs_fp8, "the target's leader and worker to run the FP8 configuration")
    assert status["accuracy"]["verdict"] == "Pass"
    assert _canaries(devcluster, ns) == []
    reasons = event_reasons(devcluster, ns)
    for reason in ("Planned", "CanaryReady", "AccuracyGatePassed", "TrafficJoined", "Promoting", "Promoted"):
        assert reason in reasons
    assert {c["type"]: c["status"] for c in status["conditions"]}["Promoted"] == "True"


def test_a_leaderworkerset_whose_canary_fails_the_accuracy_gate_is_rolled_back_untouched(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    target = lws_target(ns, max_model_len=131072)
    devcluster.create(target)
    long_context = {"model.maxModelLen": 131072, "workload.maxContextTokens": 131072}
    with operator():
        devcluster.create(lws_policy(ns, **long_context))
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    assert status["decision"]["reason"] == "AccuracyRecoveryBelowMinimum"
    after = devcluster.get(*LWS, "llama", ns)
    for key in ("leaderTemplate", "workerTemplate"):
        assert _args(after, key) == _args(target, key), "the CRD's defaults aside, the target is as it was"
        assert after["spec"]["leaderWorkerTemplate"][key]["spec"]["containers"][0]["image"] == TARGET_IMAGE
    assert _canaries(devcluster, ns) == []
    assert "AccuracyGateFailed" in event_reasons(devcluster, ns)


def test_an_operator_killed_mid_gate_resumes_the_leaderworkerset_rollout(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    fixed_image_runner: None,
    tmp_path: Path,
) -> None:
    """`kvpolicy run` as a process, SIGKILLed while the accuracy gate runs (nothing released, no status flushed),
    then another operator takes the rollout up from what the cluster holds."""
    ns = devcluster_namespace
    with operator_process(devcluster, tmp_path, "operator", "--namespace", ns) as killed:
        _to_the_gate(devcluster, ns)
        (canary,) = _canaries(devcluster, ns)
        (job,) = wait_until(lambda: gate_jobs(devcluster, ns), "the accuracy gate Job")
        killed.kill()
    assert killed.process.returncode == -signal.SIGKILL
    with operator():
        done = wait_decided(devcluster, ns)
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert event_reasons(devcluster, ns).count("Planned") == 1
    assert [j["metadata"]["uid"] for j in gate_jobs(devcluster, ns)] == [job["metadata"]["uid"]], "no second Job"
    assert canary["metadata"]["name"] == "llama-fp8-canary-g1"


def test_a_leaderworkerset_edited_mid_rollout_is_gated_again(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    with operator():
        _to_the_gate(devcluster, ns)
        # The worker template alone: a leader gated beside workers that no longer run what was gated is a change.
        edited = devcluster.get(*LWS, "llama", ns)
        worker = edited["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        worker["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
        devcluster.patch(*LWS, "llama", {"spec": {"leaderWorkerTemplate": edited["spec"]["leaderWorkerTemplate"]}}, ns)
        done = wait_decided(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "Promoted", status
    assert "TargetChanged" in event_reasons(devcluster, ns)
    assert status["canary"] is None or status["canary"]["run"] == 2
    assert devcluster.find(*LWS, "llama-fp8-canary-g1", ns) is None
    promoted = devcluster.get(*LWS, "llama", ns)
    env = promoted["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["env"]
    assert env == [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}], "the edit the rollout was gated on again stays"
    said = [e.get("message", "") for e in devcluster.list("v1", "Event", ns) if e.get("reason") == "TargetChanged"]
    assert any("worker Env" in message for message in said), said


@pytest.mark.realvllm
def test_a_leaderworkerset_of_real_vllm_servers_is_promoted_on_what_its_leader_serves(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, cpu_vllm_model: Path
) -> None:
    """Real vLLM (CPU build, a tiny random-weight Llama) in the leader and worker pods: vLLM's parser checks every
    pod's arguments, multi-host flags included; the leader serves the group and the worker (`--headless`) waits. The
    canary configuration check reads the canary leader's own vllm:cache_config_info against the target's leaders."""
    ns = devcluster_namespace
    devcluster.set_runner(RealVllmRunner(cpu_vllm_model))
    devcluster.create(lws_target(ns, max_model_len=4096, model="tiny"))

    def log(pod: str) -> str:
        return str(devcluster.call(lambda: devcluster.cluster.kubelet.read_log(ns, pod)))

    headless = "a headless node serves no API"
    wait_until(lambda: headless in log("llama-0-1"), "the worker's arguments checked by vLLM's parser", timeout=400)
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2 --node-rank 1" in log("llama-0-1")
    with operator():
        devcluster.create(tiny_model_policy(ns, **LWS_REF, **{"rollout.traffic": "Synthetic"}))
        done = wait_decided_on_real_vllm(devcluster, ns)
    status = done["status"]
    assert status["phase"] == "Promoted", status
    served_as_planned(status)
    assert status["canary"]["parallelism"] == {"tensor": 8, "pipeline": 2, "data": 1}
