"""A real kubectl against the dev cluster: apply the generated CRD and a KVPolicy, read the printer columns."""

from __future__ import annotations

import pytest
import yaml
from e2e_helpers import KUBECTL, ROOT, OperatorFactory, kubectl, policy, target, wait_phase
from kvpolicy_dev.devcluster import ThreadedDevCluster

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl missing: run `make tools`")


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
