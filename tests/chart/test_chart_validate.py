"""Rendered manifests are valid Kubernetes objects for every supported version, and the monitoring objects carry
exactly the repository's alert rules and dashboard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_helpers import REPO_ROOT, Manifest, find_tool, only, run_tool

# Chart.yaml's kubeVersion starts at 1.29 (CEL validation rules in the CRD are GA there).
KUBERNETES_VERSIONS = ["1.29", "1.30", "1.31", "1.32", "1.33"]
# Prometheus Operator kinds: kubernetes-validate has no schema for them; the tests below check them instead.
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def validate_strictly(manifests: list[Manifest], version: str) -> list[str]:
    """What `kubernetes-validate --strict -k VERSION` reports, one message per invalid manifest.

    Unlike the command line, a kind without a schema is an error here, not a warning that passes.
    """
    problems = []
    for manifest in manifests:
        if manifest["kind"] in PROMETHEUS_OPERATOR_KINDS:
            continue
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            problems.append(f"{name}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{name}: {error.message}")
    return problems


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifests_fixture", ["default_manifests", "custom_manifests", "ha_manifests"])
def test_rendered_manifests_validate_strictly(
    manifests_fixture: str, version: str, request: pytest.FixtureRequest
) -> None:
    manifests: list[Manifest] = request.getfixturevalue(manifests_fixture)
    assert validate_strictly(manifests, version) == []


def test_strict_validation_rejects_an_unknown_field(default_manifests: list[Manifest]) -> None:
    deployment = json.loads(json.dumps(only(default_manifests, "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    [problem] = validate_strictly([deployment], KUBERNETES_VERSIONS[0])
    assert "readinesProbe" in problem


def test_validation_fails_on_a_kind_without_schema() -> None:
    unknown: Manifest = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    [problem] = validate_strictly([unknown], KUBERNETES_VERSIONS[0])
    assert "Widget" in problem


def test_prometheus_rule_carries_the_repository_alerts(custom_manifests: list[Manifest]) -> None:
    rule = only(custom_manifests, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    source = yaml.safe_load((REPO_ROOT / "monitoring" / "alerts.yaml").read_text())
    assert rule["spec"] == {"groups": source["groups"]}


def test_prometheus_rule_groups_pass_promtool(custom_manifests: list[Manifest], tmp_path: Path) -> None:
    promtool = find_tool("promtool")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(only(custom_manifests, "PrometheusRule")["spec"]))
    result = run_tool([promtool, "check", "rules", rules_file])
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_dashboard_config_map_carries_the_repository_dashboard(
    custom_manifests: list[Manifest], custom_values: dict[str, Any]
) -> None:
    config_map = only(custom_manifests, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == custom_values["grafanaDashboard"]["namespace"]
    [dashboard_json] = config_map["data"].values()
    source = json.loads((REPO_ROOT / "monitoring" / "dashboard.json").read_text())
    assert json.loads(dashboard_json) == source
