"""The kubelet stand-in on the session cluster: Deployments, scheduling, pod processes, Jobs, Service URLs."""

import asyncio
import json
import os
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kvpolicy
import pytest
from kvpolicy.gate_programs.report import TERMINATION_LOG_ENV
from kvpolicy_dev.devcluster import POOL_LABEL, DevCluster, NoProcessRunner, SimulatorRunner, ThreadedDevCluster
from kvpolicy_dev.devcluster.runners import EntrypointQuirk
from prometheus_client.parser import text_string_to_metric_families

H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}
B200 = {"nvidia.com/gpu.product": "NVIDIA-B200"}


def deployment(name: str, namespace: str, replicas: int = 1, node_selector: Mapping[str, str] = H200,
               container: Mapping[str, Any] | None = None) -> dict:  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, "track": "stable"}},
                "spec": {"nodeSelector": dict(node_selector),
                         "containers": [dict(container or {"name": "main", "image": "nginx"})]},
            },
        },
    }  # fmt: skip


def job(name: str, namespace: str, command: list[str], **spec: Any) -> dict:
    container = {"name": "main", "image": "python", "command": command, **spec.pop("container", {})}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [container]}}, **spec},
    }


def available(replicas: int) -> Any:
    def check(obj: dict) -> bool:
        status = obj.get("status", {})
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        return status.get("availableReplicas") == replicas and status.get("replicas") == replicas and (
            conditions.get("Available") == "True")  # fmt: skip

    return check


def pods_of(cluster: ThreadedDevCluster, namespace: str, app: str) -> list[dict]:
    return cluster.list("v1", "Pod", namespace, label_selector=f"app={app}")


def job_finished(obj: dict) -> bool:
    return any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in obj.get("status", {}).get(
        "conditions", []))  # fmt: skip


def test_deployment_pods_run_on_the_selected_pool_and_report_ready(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    devcluster.create(deployment("web", ns, replicas=2))
    status = devcluster.wait_for("apps/v1", "Deployment", "web", ns, available(2))["status"]
    assert (status["readyReplicas"], status["updatedReplicas"], status["observedGeneration"]) == (2, 2, 1)
    pods = pods_of(devcluster, ns, "web")
    assert {pod["spec"]["nodeName"] for pod in pods} == {"h200-0"}
    assert len({pod["status"]["podIP"] for pod in pods}) == 2
    assert all(pod["metadata"]["labels"]["track"] == "stable" for pod in pods)
    owners = {(ref["kind"], ref["name"]) for pod in pods for ref in pod["metadata"]["ownerReferences"]}
    (replica_set,) = devcluster.list("apps/v1", "ReplicaSet", ns)
    assert owners == {("ReplicaSet", replica_set["metadata"]["name"])}
    assert replica_set["metadata"]["ownerReferences"][0]["name"] == "web"
    assert (replica_set["status"]["readyReplicas"], replica_set["spec"]["replicas"]) == (2, 2)


def test_pods_stay_pending_without_gpu_capacity(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    devcluster.set_pool_capacity("b200", 0)
    devcluster.create(deployment("canary", ns, node_selector=B200))

    def unschedulable(pod: dict) -> bool:
        return any(c["type"] == "PodScheduled" and c["reason"] == "Unschedulable" for c in pod["status"]["conditions"])

    devcluster.wait_for("apps/v1", "Deployment", "canary", ns, lambda d: "status" in d)  # its pod exists by now
    pod_name = pods_of(devcluster, ns, "canary")[0]["metadata"]["name"]
    pod = devcluster.wait_for("v1", "Pod", pod_name, ns, lambda p: "status" in p and unschedulable(p))
    scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    assert scheduled["status"] == "False"
    assert scheduled["message"].endswith("nodes are available: insufficient nvidia.com/gpu")
    assert pod["status"]["phase"] == "Pending" and "nodeName" not in pod["spec"]
    status = devcluster.get("apps/v1", "Deployment", "canary", ns)["status"]
    assert status["availableReplicas"] == 0
    assert {c["type"]: c["status"] for c in status["conditions"]}["Available"] == "False"
    devcluster.set_pool_capacity("b200", 1)
    devcluster.wait_for("apps/v1", "Deployment", "canary", ns, available(1))


def test_template_change_rolls_the_pods(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    devcluster.create(deployment("roll", ns))
    devcluster.wait_for("apps/v1", "Deployment", "roll", ns, available(1))
    old = {pod["metadata"]["name"] for pod in pods_of(devcluster, ns, "roll")}
    devcluster.patch(
        "apps/v1", "Deployment", "roll", {"spec": {"template": {"metadata": {"labels": {"track": "fp8"}}}}}, ns
    )
    rolled = devcluster.wait_for(
        "apps/v1", "Deployment", "roll", ns, lambda d: d["status"]["observedGeneration"] == 2 and available(1)(d)
    )
    status = rolled["status"]
    assert status["updatedReplicas"] == 1
    pods = pods_of(devcluster, ns, "roll")
    assert len(pods) == 1 and pods[0]["metadata"]["name"] not in old
    assert pods[0]["metadata"]["labels"]["track"] == "fp8"
    replicas = {
        rs["metadata"]["labels"]["track"]: rs["spec"]["replicas"] for rs in devcluster.list("apps/v1", "ReplicaSet", ns)
    }
    assert replicas == {"stable": 0, "fp8": 1}  # the old ReplicaSet stays, scaled to 0
    devcluster.patch("apps/v1", "Deployment", "roll", {"spec": {"replicas": 0}}, ns)
    devcluster.wait_for("apps/v1", "Deployment", "roll", ns, lambda d: d["status"]["replicas"] == 0)
    assert pods_of(devcluster, ns, "roll") == []


class GatedHttpRunner:
    """A pod process that records its pid, waits for a gate file, then serves /health on the pod IP."""

    SCRIPT = textwrap.dedent("""
        import http.server, os, pathlib, sys, time
        workdir, ip, port = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
        (workdir / f"pid-{ip}").write_text(str(os.getpid()))
        while not (workdir / "open").exists():
            time.sleep(0.01)
        if (workdir / "crash").exists():
            sys.exit(3)
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
                self.wfile.write(os.environ["GREETING"].encode())
            def log_message(self, *args):
                pass
        http.server.HTTPServer((ip, port), Health).serve_forever()
    """)

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def argv(self, container: Mapping[str, Any], node_labels: Mapping[str, str], pod_ip: str) -> list[str] | None:
        return [sys.executable, "-c", self.SCRIPT, str(self.workdir), pod_ip, "8000"]


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def eventually(predicate: Callable[[], bool], give_up_after: float = 10.0) -> bool:
    deadline = time.monotonic() + give_up_after
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_pod_is_ready_once_its_process_answers_health_and_dies_with_it(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, tmp_path: Path
) -> None:
    ns = devcluster_namespace
    devcluster.set_runner(GatedHttpRunner(tmp_path))
    container = {"name": "main", "image": "x", "env": [{"name": "GREETING", "value": "hi"}]}
    devcluster.create(deployment("proc", ns, container=container))
    devcluster.wait_for("apps/v1", "Deployment", "proc", ns, lambda d: "status" in d)
    pod_name = pods_of(devcluster, ns, "proc")[0]["metadata"]["name"]
    pod = devcluster.wait_for("v1", "Pod", pod_name, ns, lambda p: p.get("status", {}).get("podIP"))
    ip = pod["status"]["podIP"]
    pid_file = tmp_path / f"pid-{ip}"
    assert eventually(pid_file.exists)  # the process has started but serves nothing yet
    assert not ready(devcluster.get("v1", "Pod", pod_name, ns))
    (tmp_path / "open").touch()
    devcluster.wait_for("v1", "Pod", pod_name, ns, ready)
    with urllib.request.urlopen(f"http://{ip}:8000/health", timeout=10) as response:
        assert response.read() == b"hi"  # the container's env reached the process
    pid = int(pid_file.read_text())
    devcluster.delete("apps/v1", "Deployment", "proc", ns)
    devcluster.wait_deleted("v1", "Pod", pod_name, ns)
    assert eventually(lambda: not process_alive(pid))


def test_crashing_server_is_restarted_with_backoff(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, tmp_path: Path
) -> None:
    ns = devcluster_namespace
    (tmp_path / "open").touch()
    (tmp_path / "crash").touch()
    devcluster.set_runner(GatedHttpRunner(tmp_path))
    devcluster.create(deployment("crash", ns))
    devcluster.wait_for("apps/v1", "Deployment", "crash", ns, lambda d: "status" in d)
    pod_name = pods_of(devcluster, ns, "crash")[0]["metadata"]["name"]

    def restarted(pod: dict) -> bool:
        statuses = pod.get("status", {}).get("containerStatuses", [])
        return bool(statuses) and statuses[0]["restartCount"] >= 2

    container = devcluster.wait_for("v1", "Pod", pod_name, ns, restarted)["status"]["containerStatuses"][0]
    assert container["lastState"]["terminated"]["exitCode"] == 3 and not container["ready"]
    assert container["state"]["waiting"]["reason"] == "CrashLoopBackOff"


def test_job_runs_with_service_urls_resolved_and_reports_its_termination_message(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    devcluster.create(deployment("vllm", ns))
    devcluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "vllm", "namespace": ns},
                       "spec": {"selector": {"app": "vllm"}, "ports": [{"port": 80, "targetPort": 8000}]}})  # fmt: skip
    devcluster.wait_for("apps/v1", "Deployment", "vllm", ns, available(1))
    pod_ip = pods_of(devcluster, ns, "vllm")[0]["status"]["podIP"]
    script = (f"import json, os, sys; open(os.environ['{TERMINATION_LOG_ENV}'], 'w')"
              ".write(json.dumps({'arg': sys.argv[1], 'env': os.environ['TARGET']}))")  # fmt: skip
    devcluster.create(job("gate", ns, ["python", "-c", script, f"http://vllm.{ns}.svc.cluster.local/v1"],
                          container={"env": [{"name": "TARGET", "value": "http://vllm:80"}]}))  # fmt: skip
    status = devcluster.wait_for("batch/v1", "Job", "gate", ns, job_finished)["status"]
    assert (status["succeeded"], status["failed"], status["active"]) == (1, 0, 0)
    assert {c["type"] for c in status["conditions"] if c["status"] == "True"} == {"Complete"}
    pod = devcluster.list("v1", "Pod", ns, label_selector="job-name=gate")[0]
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (pod["status"]["phase"], terminated["exitCode"], terminated["reason"]) == ("Succeeded", 0, "Completed")
    assert json.loads(terminated["message"]) == {"arg": f"http://{pod_ip}:8000/v1", "env": f"http://{pod_ip}:8000"}


def waiting_message(pod: dict) -> str:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return statuses[0]["state"].get("waiting", {}).get("message", "") if statuses else ""


def test_job_waits_for_the_service_it_calls(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    script = f"import os, sys; open(os.environ['{TERMINATION_LOG_ENV}'], 'w').write(sys.argv[1])"
    devcluster.create(job("early", ns, ["python", "-c", script, f"http://late.{ns}.svc:80/v1"]))
    devcluster.wait_for("batch/v1", "Job", "early", ns, lambda j: j.get("status", {}).get("active") == 1)
    pod_name = devcluster.list("v1", "Pod", ns, label_selector="job-name=early")[0]["metadata"]["name"]
    pod = devcluster.wait_for("v1", "Pod", pod_name, ns, lambda p: "waiting for a ready pod" in waiting_message(p))
    assert waiting_message(pod) == f"waiting for a ready pod behind http://late.{ns}.svc:80"
    devcluster.create(deployment("late", ns))
    devcluster.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "late", "namespace": ns},
                       "spec": {"selector": {"app": "late"}, "ports": [{"port": 80, "targetPort": 8000}]}})  # fmt: skip
    devcluster.wait_for("batch/v1", "Job", "early", ns, job_finished)
    pod_ip = pods_of(devcluster, ns, "late")[0]["status"]["podIP"]
    terminated = devcluster.get("v1", "Pod", pod_name, ns)["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["message"] == f"http://{pod_ip}:8000/v1"


def test_job_gives_up_waiting_for_a_missing_service(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    kubelet = devcluster.cluster.kubelet
    patience = devcluster.call(getattr, kubelet, "service_wait_seconds")
    devcluster.call(setattr, kubelet, "service_wait_seconds", 0.2)
    try:
        script = "import sys; sys.exit(0 if sys.argv[1].startswith('http://nowhere.') else 1)"
        devcluster.create(job("hopeless", ns, ["python", "-c", script, f"http://nowhere.{ns}.svc/"]))
        status = devcluster.wait_for("batch/v1", "Job", "hopeless", ns, job_finished)["status"]
        assert status["succeeded"] == 1  # it ran, with the URL as written: a real cluster's DNS would fail it
    finally:
        devcluster.call(setattr, kubelet, "service_wait_seconds", patience)


def test_failing_job_retries_up_to_its_backoff_limit(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    ns = devcluster_namespace
    script = "import sys; print('x' * 5000 + 'the gate failed'); sys.exit(4)"
    devcluster.create(job("bad", ns, ["python", "-c", script], backoffLimit=1,
                          container={"terminationMessagePolicy": "FallbackToLogsOnError"}))  # fmt: skip
    status = devcluster.wait_for("batch/v1", "Job", "bad", ns, job_finished)["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"], status["failed"], status["succeeded"]) == (
        "True", "BackoffLimitExceeded", 2, 0)  # fmt: skip
    pods = devcluster.list("v1", "Pod", ns, label_selector="job-name=bad")
    assert [pod["status"]["phase"] for pod in pods] == ["Failed", "Failed"]
    message = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert message.endswith("the gate failed\n") and len(message.encode()) == 4096
    assert f"dev cluster pod {ns}/{pods[0]['metadata']['name']} exited with 4" in caplog.text  # with its log tail


def test_job_past_its_deadline_fails_and_is_killed(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    devcluster.create(job("slow", ns, ["python", "-c", "import time; time.sleep(60)"], activeDeadlineSeconds=1))
    status = devcluster.wait_for("batch/v1", "Job", "slow", ns, job_finished)["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded" and status["active"] == 0
    pod = devcluster.list("v1", "Pod", ns, label_selector="job-name=slow")[0]
    assert (pod["status"]["phase"], pod["status"]["reason"]) == ("Failed", "DeadlineExceeded")


def test_kvpolicy_commands_run_as_this_python(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    devcluster.create(job("version", ns, ["kvpolicy", "--version"]))
    devcluster.wait_for("batch/v1", "Job", "version", ns, lambda j: j.get("status", {}).get("succeeded") == 1)
    pod = devcluster.list("v1", "Pod", ns, label_selector="job-name=version")[0]
    log = devcluster.call(devcluster.cluster.kubelet.read_log, ns, pod["metadata"]["name"])
    assert log.strip() == kvpolicy.__version__


def test_job_with_a_missing_secret_reports_a_config_error(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    devcluster.create(job("nosecret", ns, ["python", "-c", "pass"], container={"env": env}))
    devcluster.wait_for("batch/v1", "Job", "nosecret", ns, lambda j: j.get("status", {}).get("active") == 1)
    pod_name = devcluster.list("v1", "Pod", ns, label_selector="job-name=nosecret")[0]["metadata"]["name"]

    def config_error(pod: dict) -> bool:
        statuses = pod.get("status", {}).get("containerStatuses", [])
        return bool(statuses) and "waiting" in statuses[0]["state"]

    waiting = devcluster.wait_for("v1", "Pod", pod_name, ns, config_error)["status"]["containerStatuses"][0]
    assert waiting["state"]["waiting"]["reason"] == "CreateContainerConfigError"
    assert "secretKeyRef hf/token not found" in waiting["state"]["waiting"]["message"]


@pytest.mark.parametrize("gpu", ["NVIDIA-H100-80GB-HBM3", "NVIDIA-L40S"])
async def test_vllm_deployment_runs_the_simulator(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, gpu: str
) -> None:
    ns = devcluster_namespace
    container = {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "command": ["vllm", "serve"],
                 "args": ["meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama", "--kv-cache-dtype",
                          "fp8"], "ports": [{"containerPort": 8000}],
                 "resources": {"limits": {"nvidia.com/gpu": 1}}}  # fmt: skip
    devcluster.create(deployment("vllm", ns, node_selector={"nvidia.com/gpu.product": gpu}, container=container))
    await devcluster.await_for("apps/v1", "Deployment", "vllm", ns, available(1), give_up_after=60)
    ip = pods_of(devcluster, ns, "vllm")[0]["status"]["podIP"]
    async with aiohttp.ClientSession() as http, http.get(f"http://{ip}:8000/v1/models") as response:
        models = await response.json()
    assert [model["id"] for model in models["data"]] == ["llama"]


def test_a_broken_object_does_not_hold_up_the_others(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    broken = deployment("broken", ns)
    broken["spec"]["replicas"] = "many"
    devcluster.create(broken)
    devcluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lost", "namespace": ns},
                       "spec": {"nodeName": "gone-0", "containers": [{"name": "main", "image": "nginx"}]}})  # fmt: skip
    devcluster.create(deployment("fine", ns))
    devcluster.wait_for("apps/v1", "Deployment", "fine", ns, available(1))
    lost = devcluster.wait_for("v1", "Pod", "lost", ns, lambda pod: "status" in pod)
    ready_condition = next(c for c in lost["status"]["conditions"] if c["type"] == "Ready")
    assert (ready_condition["reason"], lost["status"]["phase"]) == ("NodeNotFound", "Pending")
    assert "status" not in devcluster.get("apps/v1", "Deployment", "broken", ns)


async def test_an_image_whose_entrypoint_drops_a_flag_serves_what_vllm_really_got(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    # The pod spec asks for an FP8 KV cache; the image's wrapper loses the flag, and the server's own
    # vllm:cache_config_info says so (what an operator can check a canary against).
    ns = devcluster_namespace
    lossy = SimulatorRunner(time_scale=0.001, quirks={"vllm-lossy:1": EntrypointQuirk(drop=("--kv-cache-dtype",))})
    devcluster.set_runner(lossy)
    served = {}
    for image in ("vllm-lossy:1", "vllm/vllm-openai:v0.11.0"):
        name = image.split(":")[0].split("/")[-1]
        container = {"name": "vllm", "image": image, "command": ["vllm", "serve"],
                     "args": ["llama", "--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0"],
                     "ports": [{"containerPort": 8000}]}  # fmt: skip
        devcluster.create(deployment(name, ns, node_selector={POOL_LABEL: "h200"}, container=container))
        await devcluster.await_for("apps/v1", "Deployment", name, ns, available(1), give_up_after=60)
        ip = pods_of(devcluster, ns, name)[0]["status"]["podIP"]
        async with aiohttp.ClientSession() as http, http.get(f"http://{ip}:8000/metrics") as response:
            families = {family.name: family for family in text_string_to_metric_families(await response.text())}
        (sample,) = families["vllm:cache_config_info"].samples
        served[image] = (sample.labels["cache_dtype"], sample.labels["kv_cache_dtype_skip_layers"])
    assert served == {"vllm-lossy:1": ("auto", "['0']"), "vllm/vllm-openai:v0.11.0": ("fp8", "['0']")}


async def test_writes_of_kinds_the_kubelet_does_not_run_cost_it_no_pass() -> None:
    """A pass looks at every Deployment, ReplicaSet, Job and Pod: after each of thousands of KVPolicy, Event or Lease
    writes, that made the emulated cluster quadratic in the number of policies."""
    async with DevCluster(runner=NoProcessRunner(), namespaces=("ns",)) as cluster:
        passes = 0
        reconcile = cluster.kubelet.reconcile

        def counted() -> float | None:
            nonlocal passes
            passes += 1
            return reconcile()

        cluster.kubelet.reconcile = counted  # type: ignore[method-assign]
        await asyncio.sleep(0.2)
        before = passes
        for index in range(50):
            cluster.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                            "metadata": {"name": f"lease-{index}", "namespace": "ns"}, "spec": {}})  # fmt: skip
            await asyncio.sleep(0.01)  # one write at a time, as clients send them
        await asyncio.sleep(0.5)
        assert passes == before, "no pass for a Lease"
        cluster.create(deployment("web", "ns"))
        await cluster.wait_for("apps/v1", "Deployment", "web", "ns", available(1))
        assert passes > before, "a Deployment is the kubelet's"
