"""The chart's optional hardening: two replicas with leader election and a PodDisruptionBudget, the egress
NetworkPolicy, listen addresses, and the ServiceMonitor's honorLabels. (kubernetes-validate checks every rendered
object in test_chart_validate.py, the HA values included.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from chart_helpers import (
    RELEASE_NAMESPACE,
    REPO_ROOT,
    Manifest,
    Renderer,
    RenderError,
    granted,
    of_kind,
    only,
    operator_container,
)
from kvpolicy.runtime.run import _parser as run_parser

LEASES = {("coordination.k8s.io", "leases", verb) for verb in ("get", "create", "update")}


def lease_roles(manifests: list[Manifest]) -> list[Manifest]:
    roles = of_kind(manifests, "Role") + of_kind(manifests, "ClusterRole")
    return [role for role in roles if any(group == "coordination.k8s.io" for group, _, _ in granted(role))]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {entry["name"]: entry.get("value", entry.get("valueFrom")) for entry in container["env"]}


# --- replicas, leader election, PodDisruptionBudget ----------------------------------------------------------------


@pytest.mark.parametrize("manifests_fixture", ["default_manifests", "custom_manifests"])
def test_one_replica_gets_no_lease_rbac_and_no_budget(manifests_fixture: str, request: pytest.FixtureRequest) -> None:
    manifests: list[Manifest] = request.getfixturevalue(manifests_fixture)
    assert lease_roles(manifests) == []
    assert of_kind(manifests, "PodDisruptionBudget") == []
    assert "KVPOLICY_LEADER_ELECTION_LEASE" not in env(operator_container(manifests))


def test_two_replicas_elect_a_leader_through_a_lease(ha_manifests: list[Manifest]) -> None:
    deployment = only(ha_manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    [role] = lease_roles(ha_manifests)
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert granted(role) == LEASES
    [binding] = [b for b in of_kind(ha_manifests, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]]
    account = only(ha_manifests, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": RELEASE_NAMESPACE}]
    variables = env(operator_container(ha_manifests))
    assert variables["KVPOLICY_LEADER_ELECTION_LEASE"] == "kvp-kvpolicy-operator-leader"
    assert variables["KVPOLICY_LEADER_ELECTION_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert variables["KVPOLICY_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Spread over nodes, so that losing one node leaves the standby.
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_budget_keeps_one_operator_through_drains(ha_manifests: list[Manifest]) -> None:
    budget = only(ha_manifests, "PodDisruptionBudget")
    pod_labels = only(ha_manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_leader_election_on_one_replica_keeps_recreate(render: Renderer) -> None:
    manifests = render("--set", "leaderElection.enabled=true")
    assert only(manifests, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert granted(lease_roles(manifests)[0]) == LEASES


@pytest.mark.parametrize(
    ("values", "error"),
    [
        (["replicaCount=2"], "replicaCount > 1 needs leaderElection.enabled"),
        (["podDisruptionBudget.enabled=true"], "needs replicaCount > podDisruptionBudget.minAvailable"),
        (["replicaCount=0"], "replicaCount: Must be greater than or equal to 1"),
        (["addresses.metrics=localhost"], "addresses.metrics: Does not match pattern"),
        (["networkPolicy.enabled=true"], "networkPolicy.enabled needs networkPolicy.apiServerCIDRs"),
        (["networkPolicy.apiServerCIDRs={10.0.0.1}"], "networkPolicy.apiServerCIDRs.0: Does not match pattern"),
    ],
)
def test_unsafe_or_malformed_values_are_refused(render: Renderer, values: list[str], error: str) -> None:
    with pytest.raises(RenderError, match=re.escape(error)):
        render(*[arg for value in values for arg in ("--set", value)])


# --- listen addresses -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("manifests_fixture", "health", "metrics"),
    [("default_manifests", "0.0.0.0", "0.0.0.0"), ("custom_manifests", "::", "::")],
)
def test_listen_addresses_reach_kvpolicy_run(
    manifests_fixture: str, health: str, metrics: str, request: pytest.FixtureRequest
) -> None:
    args = run_parser().parse_args(operator_container(request.getfixturevalue(manifests_fixture))["args"])
    assert (args.liveness_address, args.metrics_address) == (health, metrics)


# --- NetworkPolicy ----------------------------------------------------------------------------------------------


def test_egress_policy_allows_only_the_listed_destinations(
    custom_manifests: list[Manifest], custom_values: dict[str, Any]
) -> None:
    policy = only(custom_manifests, "NetworkPolicy")
    spec = policy["spec"]
    pod_labels = only(custom_manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Egress"]
    api, dns, serving, prometheus, extra = spec["egress"]
    wanted = custom_values["networkPolicy"]
    assert [peer["ipBlock"]["cidr"] for peer in api["to"]] == wanted["apiServerCIDRs"]
    assert [port["port"] for port in api["ports"]] == [443]
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert {(port["protocol"], port["port"]) for port in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    # Serving pods only in the watched namespaces.
    namespaces = [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for peer in serving["to"]]
    assert namespaces == custom_values["watchNamespaces"]
    assert [port["port"] for port in serving["ports"]] == [8000, 8080]
    assert prometheus["to"] == wanted["prometheus"]["peers"]
    assert extra == wanted["extraEgress"][0]


def test_egress_policy_without_prometheus_peers_reaches_no_prometheus(render: Renderer) -> None:
    manifests = render("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.apiServerCIDRs={10.0.0.1/32}")
    egress = only(manifests, "NetworkPolicy")["spec"]["egress"]
    assert len(egress) == 3  # API, DNS, serving pods (every namespace without watchNamespaces)
    assert egress[2]["to"] == [{"namespaceSelector": {}}]
    assert all(port["port"] != 9090 for rule in egress for port in rule["ports"])


# --- ServiceMonitor ----------------------------------------------------------------------------------------------


def test_service_monitor_honors_the_operators_namespace_label(custom_manifests: list[Manifest]) -> None:
    [endpoint] = only(custom_manifests, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True


# --- runbooks -------------------------------------------------------------------------------------------------------

SELECTOR = re.compile(r"-l\s+([\w./-]+)=([\w.-]+)")


def test_runbook_and_alert_label_selectors_match_the_charts_pods(default_manifests: list[Manifest]) -> None:
    """`kubectl get pods -l ...` in the runbooks and alert descriptions finds the operator the chart installs."""
    monitoring = REPO_ROOT / "monitoring"
    alerts = yaml.safe_load((monitoring / "alerts.yaml").read_text())["groups"]
    descriptions = [rule["annotations"]["description"] for group in alerts for rule in group["rules"]]
    texts = [(monitoring / "runbooks.md").read_text(), *descriptions]
    selectors = {match.groups() for text in texts for match in SELECTOR.finditer(text)}
    operator_selectors = {(key, value) for key, value in selectors if key.startswith("app.kubernetes.io/")}
    assert operator_selectors, "no selector for the operator's pods"
    pod_labels = only(default_manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert operator_selectors <= set(pod_labels.items())
