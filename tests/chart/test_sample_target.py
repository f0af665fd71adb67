"""examples/target/: the complete vLLM target (Deployment, Service, PodMonitor) that the README's quick start applies
beside examples/llama-3.1-8b-h100-128k.yaml. It must be what a real API server accepts, match what the policy names,
and give the operator a canary it can run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_helpers import REPO_ROOT
from kvpolicy.api.v1alpha1 import KVPolicy, Plan
from kvpolicy.planning import cli as plan_cli
from kvpolicy.rollout import builders as b

TARGET = REPO_ROOT / "examples" / "target" / "llama-8b.yaml"
POLICY = REPO_ROOT / "examples" / "llama-3.1-8b-h100-128k.yaml"
KUBERNETES_VERSIONS = ["1.29", "1.33"]


def _objects(path: Path) -> dict[str, dict[str, Any]]:
    return {document["kind"]: document for document in yaml.safe_load_all(path.read_text())}


@pytest.fixture(scope="module")
def target() -> dict[str, dict[str, Any]]:
    return _objects(TARGET)


@pytest.fixture(scope="module")
def policy() -> KVPolicy:
    return KVPolicy.model_validate(yaml.safe_load(POLICY.read_text()))


def _container(deployment: dict[str, Any], name: str | None) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return containers[b.index_in(containers, name, "the sample target")]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_deployment_and_service_are_valid_kubernetes_objects(
    target: dict[str, dict[str, Any]], version: str
) -> None:
    for kind in ("Deployment", "Service"):
        kubernetes_validate.validate(target[kind], version, strict=True)


def test_the_policy_names_this_target_and_its_model(target: dict[str, dict[str, Any]], policy: KVPolicy) -> None:
    deployment = target["Deployment"]
    assert deployment["metadata"]["name"] == policy.spec.target_ref.name
    assert deployment["metadata"]["namespace"] == policy.metadata["namespace"]
    container = _container(deployment, policy.spec.target_ref.container)
    assert container["image"] == policy.spec.images.baseline
    args = container["args"]
    assert f"--served-model-name={policy.spec.model.served_model_name}" in args
    assert f"--max-model-len={policy.spec.model.max_model_len}" in args
    assert target["Service"]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_the_operator_builds_a_valid_fp8_canary_from_it(
    target: dict[str, dict[str, Any]], policy: KVPolicy, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_cli.main(["-f", str(POLICY), "--gpu", "H100", "-o", "json"]) == 0
    plan = Plan.model_validate(json.loads(capsys.readouterr().out)["plan"])
    ref = b.PolicyRef(policy.metadata["name"], policy.metadata["namespace"], "uid-1")
    canary = b.canary_deployment(ref, "llama-8b-longdoc-canary-g1", target["Deployment"], policy.spec, plan)
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(canary, version, strict=True)
    container = _container(canary, policy.spec.target_ref.container)
    assert b.kv_cache_dtype(b.serving_tokens(b.container_record(container))) == "fp8"
    assert b.serving_port(container) == 8000


def test_the_pod_monitor_scrapes_the_serving_port_and_leaves_canaries_to_the_charts(
    target: dict[str, dict[str, Any]],
) -> None:
    deployment, monitor = target["Deployment"], target["PodMonitor"]
    ports = {port["name"] for port in _container(deployment, "vllm")["ports"]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and target["Service"]["spec"]["ports"][0]["targetPort"] in ports
    assert monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    # Prometheus' Kubernetes discovery turns a pod label into __meta_kubernetes_pod_label_<name, [^a-zA-Z0-9_] -> _>.
    canary_label = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", b.ROLE_LABEL)
    assert {"sourceLabels": [canary_label], "regex": b.ROLE_CANARY, "action": "drop"} in endpoint["relabelings"]
