"""A real kubectl against the dev cluster: apply the generated CRD and a KVPolicy, read the printer columns."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from e2e_helpers import OperatorFactory, policy, target, wait_phase
from kvpolicy_dev.devcluster import ThreadedDevCluster

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl missing: run `make tools`")


def kubectl(cluster: ThreadedDevCluster, *args: str, stdin: str = "") -> str:
    assert KUBECTL is not None
    env = {**os.environ, **cluster.environ(), "HOME": str(cluster.kubeconfig.parent)}
    result = subprocess.run([KUBECTL, *args], input=stdin, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_kubectl_applies_a_kvpolicy_and_shows_its_progress(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    kubectl(devcluster, "apply", "-f", str(ROOT / "crds" / "kvpolicy.yaml"))
    devcluster.create(target(ns))
    manifest = policy(ns, **{"workload.maxContextTokens": 4096, "workload.typicalContextTokens": 2048})
    assert "created" in kubectl(devcluster, "apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    header, row = kubectl(devcluster, "get", "kvp", "--namespace", ns).splitlines()
    assert header.split() == ["NAME", "PHASE", "KV", "GPU", "DECISION", "REASON", "AGE"]
    assert row.split()[0] == "llama-fp8"
    with operator():
        wait_phase(devcluster, ns, {"HeldBF16"})
    header, row = kubectl(devcluster, "get", "kvpolicies", "--namespace", ns).splitlines()
    assert row.split()[:6] == ["llama-fp8", "HeldBF16", "BF16", "NVIDIA-H200", "HeldBF16", "BelowDecodeBreakEven"]
