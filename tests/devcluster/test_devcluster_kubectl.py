"""The real kubectl (installed by tools/install_k8s_binaries.py) against the dev cluster."""

import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpolicy_dev.devcluster import ThreadedDevCluster

KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl missing: run `make tools`")

CRD_YAML = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: rollouts.kubectl.example.dev
spec:
  group: kubectl.example.dev
  scope: Namespaced
  names: {plural: rollouts, singular: rollout, kind: Rollout, shortNames: [ro]}
  versions:
  - name: v1alpha1
    served: true
    storage: true
    subresources: {status: {}}
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
    additionalPrinterColumns:
    - {name: Model, type: string, jsonPath: .spec.model}
    - {name: Phase, type: string, jsonPath: .status.phase}
    - {name: Ready, type: string, jsonPath: '.status.conditions[?(@.type=="Ready")].status'}
"""
ROLLOUT_YAML = """
apiVersion: kubectl.example.dev/v1alpha1
kind: Rollout
metadata: {name: llama}
spec: {model: meta-llama/Llama-3.1-8B-Instruct}
"""


def kubectl(cluster: ThreadedDevCluster, *args: str, stdin: str = "") -> str:
    assert KUBECTL is not None
    env = {**os.environ, **cluster.environ(), "HOME": str(cluster.kubeconfig.parent)}  # discovery cache in the workdir
    result = subprocess.run([KUBECTL, *args], input=stdin, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def rollout_crd(devcluster: ThreadedDevCluster) -> Iterator[None]:
    yield
    devcluster.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", "rollouts.kubectl.example.dev")


def test_kubectl_applies_a_crd_and_prints_its_columns(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, rollout_crd: None
) -> None:
    ns = ["--namespace", devcluster_namespace]
    assert "created" in kubectl(devcluster, "apply", "-f", "-", stdin=CRD_YAML)
    assert "created" in kubectl(devcluster, "apply", *ns, "-f", "-", stdin=ROLLOUT_YAML)
    devcluster.patch("kubectl.example.dev/v1alpha1", "Rollout", "llama",
                     {"status": {"phase": "Canary", "conditions": [{"type": "Ready", "status": "False"}]}},
                     devcluster_namespace, subresource="status")  # fmt: skip
    header, row = kubectl(devcluster, "get", "ro", *ns).splitlines()
    assert header.split() == ["NAME", "MODEL", "PHASE", "READY"]
    assert row.split() == ["llama", "meta-llama/Llama-3.1-8B-Instruct", "Canary", "False"]
    # A second apply is a patch of the live object (kubectl's client-side apply).
    changed = ROLLOUT_YAML.replace("Llama-3.1-8B-Instruct", "Llama-3.1-70B-Instruct")
    assert "configured" in kubectl(devcluster, "apply", *ns, "-f", "-", stdin=changed)
    live = devcluster.get("kubectl.example.dev/v1alpha1", "Rollout", "llama", devcluster_namespace)
    assert live["spec"]["model"].endswith("70B-Instruct") and live["metadata"]["generation"] == 2
    assert live["status"]["phase"] == "Canary"


def test_kubectl_get_watch_prints_rows_as_they_change(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, rollout_crd: None
) -> None:
    assert KUBECTL is not None
    ns = devcluster_namespace
    kubectl(devcluster, "apply", "-f", "-", stdin=CRD_YAML)
    kubectl(devcluster, "apply", "--namespace", ns, "-f", "-", stdin=ROLLOUT_YAML)
    env = {**os.environ, **devcluster.environ(), "HOME": str(devcluster.kubeconfig.parent)}
    watch = subprocess.Popen([KUBECTL, "get", "ro", "--namespace", ns, "--watch"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout or []], daemon=True).start()
    try:
        assert lines.get(timeout=30).split() == ["NAME", "MODEL", "PHASE", "READY"]
        assert lines.get(timeout=30).split() == ["llama", "meta-llama/Llama-3.1-8B-Instruct"]
        devcluster.patch("kubectl.example.dev/v1alpha1", "Rollout", "llama", {"status": {"phase": "Promoted"}}, ns,
                         subresource="status")  # fmt: skip
        assert lines.get(timeout=30).split() == ["llama", "meta-llama/Llama-3.1-8B-Instruct", "Promoted"]
    finally:
        watch.terminate()
        watch.wait()


def test_kubectl_scales_a_deployment(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    devcluster.create({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": ns},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}}, "template": {
            "metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "main", "image": "nginx"}]}}},
    })  # fmt: skip
    assert "scaled" in kubectl(devcluster, "scale", "--namespace", ns, "deployment/web", "--replicas=3")
    devcluster.wait_for("apps/v1", "Deployment", "web", ns, lambda d: d.get("status", {}).get("readyReplicas") == 3)
    assert "successfully rolled out" in kubectl(devcluster, "rollout", "status", "--namespace", ns, "deployment/web")


def test_kubectl_reapply_merges_containers_by_name(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    manifest = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: vllm}
spec:
  selector: {matchLabels: {app: vllm}}
  template:
    metadata: {labels: {app: vllm}}
    spec:
      containers:
      - {name: vllm, image: "vllm:1", args: [serve, m], env: [{name: A, value: "1"}]}
      - {name: sidecar, image: "proxy:1"}
"""
    ns = ["--namespace", devcluster_namespace]
    kubectl(devcluster, "apply", *ns, "-f", "-", stdin=manifest)
    kubectl(devcluster, "apply", *ns, "-f", "-", stdin=manifest.replace("vllm:1", "vllm:2"))
    containers = devcluster.get("apps/v1", "Deployment", "vllm", devcluster_namespace)["spec"]["template"]["spec"][
        "containers"
    ]
    assert containers == [
        {"name": "vllm", "image": "vllm:2", "args": ["serve", "m"], "env": [{"name": "A", "value": "1"}]},
        {"name": "sidecar", "image": "proxy:1"},
    ]


def test_kubectl_get_pods_and_logs(devcluster: ThreadedDevCluster, devcluster_namespace: str) -> None:
    devcluster.create({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "hello", "namespace": devcluster_namespace},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [
            {"name": "main", "image": "python", "command": ["python", "-c", "print('hello from the job')"]}]}}},
    })  # fmt: skip
    devcluster.wait_for("batch/v1", "Job", "hello", devcluster_namespace, lambda job: job["status"].get("succeeded"))
    pods = kubectl(devcluster, "get", "pods", "--namespace", devcluster_namespace, "-l", "job-name=hello", "-o", "name")
    assert pods.startswith("pod/hello-")
    logs = kubectl(devcluster, "logs", "--namespace", devcluster_namespace, pods.strip())
    assert logs == "hello from the job\n"
