"""The real helm (installed by tools/install_k8s_binaries.py) installs, upgrades and uninstalls into the dev cluster."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvpolicy_dev.devcluster import ThreadedDevCluster

HELM = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm missing: run `make tools`")

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: "{{ .Release.Name }}-web"}
spec:
  replicas: {{ .Values.replicas }}
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers: [{name: main, image: "nginx:{{ .Values.tag }}"}]
"""


def helm(cluster: ThreadedDevCluster, tmp_path: Path, *args: str) -> str:
    assert HELM is not None
    env = {**os.environ, **cluster.environ(), "HOME": str(tmp_path)}
    result = subprocess.run([HELM, *args], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_helm_release_lifecycle(devcluster: ThreadedDevCluster, devcluster_namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: web\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("replicas: 2\ntag: '1.27'\n")
    (chart / "templates" / "deployment.yaml").write_text(DEPLOYMENT)
    ns = ["--namespace", devcluster_namespace]
    helm(devcluster, tmp_path, "install", "rel", str(chart), *ns, "--wait", "--timeout", "60s")
    deployment = devcluster.get("apps/v1", "Deployment", "rel-web", devcluster_namespace)
    assert deployment["status"]["availableReplicas"] == 2
    release_secrets = devcluster.list("v1", "Secret", devcluster_namespace, label_selector="owner=helm")
    assert [s["metadata"]["labels"]["status"] for s in release_secrets] == ["deployed"]

    helm(devcluster, tmp_path, "upgrade", "rel", str(chart), *ns, "--set", "tag=1.28", "--wait", "--timeout", "60s")
    deployment = devcluster.get("apps/v1", "Deployment", "rel-web", devcluster_namespace)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "nginx:1.28"
    assert deployment["status"]["updatedReplicas"] == 2
    assert "rel" in helm(devcluster, tmp_path, "list", *ns)

    helm(devcluster, tmp_path, "uninstall", "rel", *ns, "--wait")
    assert devcluster.find("apps/v1", "Deployment", "rel-web", devcluster_namespace) is None
    assert devcluster.list("v1", "Pod", devcluster_namespace) == []
