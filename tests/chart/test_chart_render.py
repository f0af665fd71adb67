"""The chart lints, renders with default and non-default values, and renders what the operator needs to run safely."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART_DIR,
    CUSTOM_VALUES,
    HA_VALUES,
    REGISTRY,
    RELEASE,
    RELEASE_NAMESPACE,
    Manifest,
    Renderer,
    RenderError,
    Triple,
    granted,
    of_kind,
    only,
    operator_cluster_role,
    operator_container,
    operator_rbac,
    run_tool,
)


@pytest.mark.parametrize(
    "values", [[], ["--values", CUSTOM_VALUES], ["--values", HA_VALUES]], ids=["default", "custom", "ha"]
)
def test_helm_lint_strict_passes(helm: Path, values: list[str | Path]) -> None:
    result = run_tool([helm, "lint", "--strict", CHART_DIR, "--set", f"imageRegistry={REGISTRY}", *values])
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_registry_is_required_since_no_image_is_published(helm: Path) -> None:
    """Issue 23 item 12: the defaults named images nobody publishes (ghcr.io/kvpolicy/...); an install without the
    registry now fails at once, saying what to build and set, instead of pods in ImagePullBackOff."""
    result = run_tool([helm, "template", RELEASE, CHART_DIR, "--namespace", RELEASE_NAMESPACE])
    assert result.returncode != 0
    assert "imageRegistry is required: no kvpolicy image is published" in result.stderr
    full_names = ["--set", "image.repository=r.example/ops/kvpolicy-operator"]
    full_names += ["--set", "probeImage.repository=r.example/ops/vllm-fp8-twolevel"]
    rendered = run_tool([helm, "template", RELEASE, CHART_DIR, *full_names])
    assert rendered.returncode == 0, rendered.stderr  # the README's install line: full names, no registry
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert "ghcr.io" not in yaml.safe_dump(values) and values["imageRegistry"] == ""


@pytest.mark.parametrize(
    ("set_value", "error"),
    [
        ("imagePullPolicy=Always", "Additional property imagePullPolicy is not allowed"),
        ("image.pullPolicy=Sometimes", "image.pullPolicy must be one of the following"),
        ("watchNamespaces=llm-serving", "watchNamespaces: Invalid type. Expected: array"),
        ("watchNamespaces={LLM_Serving}", "watchNamespaces.0: Does not match pattern"),
        ("ports.metrics=70000", "ports.metrics: Must be less than or equal to 65535"),
        ("serviceMonitor.interval=30", "serviceMonitor.interval: Invalid type"),
        ("extraArgs={verbose}", "extraArgs.0: Does not match pattern"),
    ],
)
def test_values_schema_rejects_bad_values(render: Renderer, set_value: str, error: str) -> None:
    with pytest.raises(RenderError, match=re.escape(error)):
        render("--set", set_value)


@pytest.mark.parametrize(
    ("enable", "missing", "error"),
    [
        ("prometheusRule.enabled=true", "files/alerts.yaml", "copy monitoring/alerts.yaml into the chart"),
        ("grafanaDashboard.enabled=true", "files/dashboard.json", "copy monitoring/dashboard.json into the chart"),
    ],
)
def test_enabled_monitoring_object_without_its_file_fails_clearly(
    render: Renderer, tmp_path: Path, enable: str, missing: str, error: str
) -> None:
    chart = tmp_path / CHART_DIR.name
    shutil.copytree(CHART_DIR, chart)
    (chart / missing).unlink()
    with pytest.raises(RenderError, match=re.escape(error)):
        render("--set", enable, chart=chart)


def test_clusters_older_than_1_29_are_refused(render: Renderer) -> None:
    """The CRD's CEL validation rules need Kubernetes 1.29."""
    with pytest.raises(RenderError, match=re.escape("incompatible with Kubernetes v1.28.9")):
        render("--kube-version", "1.28.9")


def test_defaults_render_only_the_core_objects(default_manifests: list[Manifest]) -> None:
    kinds = sorted(manifest["kind"] for manifest in default_manifests)
    assert kinds == [
        "ClusterRole",  # the operator's
        "ClusterRole",  # kvpolicy-view
        "ClusterRole",  # kvpolicy-edit
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "Service",
        "ServiceAccount",
    ]


def test_custom_values_render_every_optional_object(custom_manifests: list[Manifest]) -> None:
    kinds = {manifest["kind"] for manifest in custom_manifests}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap", "Role", "RoleBinding"} <= kinds


def flag_value(args: list[str], flag: str) -> str:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{flag}=")]
    assert len(values) == 1, f"{flag} given {len(values)} times in {args}"
    return values[0]


def env_value(container: dict[str, Any], name: str) -> str:
    values = [entry["value"] for entry in container["env"] if entry["name"] == name]
    assert len(values) == 1, f"{name} set {len(values)} times"
    return str(values[0])


@pytest.mark.parametrize("manifests_fixture", ["default_manifests", "custom_manifests"])
def test_deployment_is_one_recreated_replica_locked_down(
    manifests_fixture: str, request: pytest.FixtureRequest
) -> None:
    manifests: list[Manifest] = request.getfixturevalue(manifests_fixture)
    deployment = only(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    container = operator_container(manifests)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    for bound in ("requests", "limits"):
        assert "memory" in container["resources"][bound], f"no memory {bound}"
    assert "cpu" in container["resources"]["requests"]
    mounted = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert "/tmp" in mounted, "a read-only root filesystem needs a writable /tmp"


@pytest.mark.parametrize("manifests_fixture", ["default_manifests", "custom_manifests"])
def test_probes_and_metrics_service_reach_the_ports_the_operator_listens_on(
    manifests_fixture: str, request: pytest.FixtureRequest
) -> None:
    manifests: list[Manifest] = request.getfixturevalue(manifests_fixture)
    container = operator_container(manifests)
    port_numbers = {port["name"]: port["containerPort"] for port in container["ports"]}
    liveness_port = int(flag_value(container["args"], "--liveness-port"))
    metrics_port = int(flag_value(container["args"], "--metrics-port"))
    for probe_name in ("livenessProbe", "readinessProbe"):
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == "/healthz"
        assert port_numbers[probe["port"]] == liveness_port, probe_name
    service = only(manifests, "Service")
    [service_port] = service["spec"]["ports"]
    assert port_numbers[service_port["targetPort"]] == metrics_port
    pod_labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_default_mode_watches_all_namespaces(default_manifests: list[Manifest]) -> None:
    args = operator_container(default_manifests)["args"]
    assert "--all-namespaces" in args
    assert not [arg for arg in args if arg.startswith("--namespace")]


def test_watch_namespaces_become_namespace_flags(
    custom_manifests: list[Manifest], custom_values: dict[str, Any]
) -> None:
    args = operator_container(custom_manifests)["args"]
    assert "--all-namespaces" not in args
    namespaces = [arg.removeprefix("--namespace=") for arg in args if arg.startswith("--namespace=")]
    assert namespaces == custom_values["watchNamespaces"]
    assert args[-len(custom_values["extraArgs"]) :] == custom_values["extraArgs"]


def test_gate_image_defaults_to_the_operator_image(default_manifests: list[Manifest]) -> None:
    container = operator_container(default_manifests)
    assert env_value(container, "KVPOLICY_GATE_IMAGE") == container["image"]
    assert container["image"] == f"{REGISTRY}/kvpolicy-operator:0.1.0"
    assert env_value(container, "KVPOLICY_PROBE_IMAGE").startswith(f"{REGISTRY}/vllm-fp8-twolevel:")


def test_custom_images_reach_the_operator(custom_manifests: list[Manifest], custom_values: dict[str, Any]) -> None:
    container = operator_container(custom_manifests)
    image, gate, probe = custom_values["image"], custom_values["gateImage"], custom_values["probeImage"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    assert env_value(container, "KVPOLICY_GATE_IMAGE") == f"{gate['repository']}:{gate['tag']}"
    assert env_value(container, "KVPOLICY_PROBE_IMAGE") == f"{probe['repository']}:{probe['tag']}"
    assert env_value(container, "TZ") == "UTC"


# --- RBAC -------------------------------------------------------------------------------------------------------

README_ROW = re.compile(
    r"^\| `(?P<group>[^`]*)`[^|]*\| `(?P<resource>[^`]+)` \| (?P<verbs>[a-z, ]+) \| (?P<scope>[^|]+) \|"
)


def documented_rbac() -> dict[str, set[Triple]]:
    """(group, resource, verb) triples of the chart README's RBAC table, by scope column."""
    by_scope: dict[str, set[Triple]] = {}
    for line in (CHART_DIR / "README.md").read_text().splitlines():
        row = README_ROW.match(line)
        if row:
            group = row["group"].strip('"')  # the core group is written `""`
            triples = {(group, row["resource"], verb.strip()) for verb in row["verbs"].split(",")}
            by_scope.setdefault(row["scope"].strip(), set()).update(triples)
    scopes = {
        "namespaced",
        "namespaced, with gatewayAPI.enabled",
        "cluster",
        "cluster, with watchNamespaces",
        "release namespace, with leader election",
    }
    scopes |= {f"namespaced, with `targets.{kind}.enabled`" for kind in ("leaderWorkerSet", "llmInferenceService")}
    assert set(by_scope) == scopes, by_scope.keys()
    return by_scope


def test_readme_rbac_table_parses_into_every_scope() -> None:
    documented = documented_rbac()
    assert ("kvpolicy.dev", "kvpolicies/status", "patch") in documented["namespaced"]
    assert ("", "nodes", "list") in documented["cluster"]


def test_leader_election_role_grants_exactly_the_documented_rules(ha_manifests: list[Manifest]) -> None:
    [role] = [role for role in of_kind(ha_manifests, "Role") if role["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert granted(role) == documented_rbac()["release namespace, with leader election"]


def test_all_namespaces_cluster_role_grants_exactly_the_documented_rules(default_manifests: list[Manifest]) -> None:
    documented = documented_rbac()
    assert granted(operator_cluster_role(default_manifests)) == documented["namespaced"] | documented["cluster"]
    assert not of_kind(default_manifests, "Role")


def test_watch_namespaces_get_a_role_each_and_a_cluster_role_for_cluster_reads(
    custom_manifests: list[Manifest], custom_values: dict[str, Any]
) -> None:
    documented = documented_rbac()
    cluster_role = operator_cluster_role(custom_manifests)
    assert granted(cluster_role) == documented["cluster"] | documented["cluster, with watchNamespaces"]
    roles = of_kind(custom_manifests, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == sorted(custom_values["watchNamespaces"])
    for role in roles:
        assert granted(role) == documented["namespaced"]
    bindings = of_kind(custom_manifests, "RoleBinding")
    role_names = {(role["metadata"]["namespace"], role["metadata"]["name"]) for role in roles}
    assert {(binding["metadata"]["namespace"], binding["roleRef"]["name"]) for binding in bindings} == role_names
    assert only(custom_manifests, "ClusterRoleBinding")["roleRef"]["name"] == cluster_role["metadata"]["name"]


def test_gateway_api_rollouts_add_exactly_the_route_and_pool_rules_and_tell_the_operator(render: Renderer) -> None:
    documented = documented_rbac()
    manifests = render("--set", "gatewayAPI.enabled=true")
    gateway = documented["namespaced, with gatewayAPI.enabled"]
    assert ("gateway.networking.k8s.io", "httproutes", "patch") in gateway
    assert granted(operator_cluster_role(manifests)) == documented["namespaced"] | gateway | documented["cluster"]
    env = {entry["name"]: entry.get("value") for entry in operator_container(manifests)["env"]}
    assert env["KVPOLICY_READ_INFERENCE_POOLS"] == "true"
    namespaced = render("--set", "gatewayAPI.enabled=true", "--set", "watchNamespaces={llm}")
    [role] = of_kind(namespaced, "Role")
    assert granted(role) == documented["namespaced"] | gateway


@pytest.mark.parametrize("manifests_fixture", ["default_manifests", "custom_manifests"])
def test_rbac_has_no_wildcards_and_no_secrets(manifests_fixture: str, request: pytest.FixtureRequest) -> None:
    manifests: list[Manifest] = request.getfixturevalue(manifests_fixture)
    roles = of_kind(manifests, "ClusterRole") + of_kind(manifests, "Role")
    for group, resource, verb in set().union(*(granted(role) for role in roles)):
        assert "*" not in (group, resource, verb)
        assert resource not in ("secrets", "configmaps")


@pytest.mark.parametrize("manifests_fixture", ["default_manifests", "custom_manifests"])
def test_bindings_name_the_operator_service_account(manifests_fixture: str, request: pytest.FixtureRequest) -> None:
    manifests: list[Manifest] = request.getfixturevalue(manifests_fixture)
    account = only(manifests, "ServiceAccount")["metadata"]
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["name"]
    for binding in of_kind(manifests, "ClusterRoleBinding") + of_kind(manifests, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["name"], "namespace": RELEASE_NAMESPACE}
        ]


# --- monitoring ---------------------------------------------------------------------------------------------------


def test_service_monitor_selects_the_metrics_service(custom_manifests: list[Manifest]) -> None:
    monitor = only(custom_manifests, "ServiceMonitor")
    service = only(custom_manifests, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_other_services_would_not_be_scraped(custom_manifests: list[Manifest]) -> None:
    """The selector is specific to this release: another release's operator Service does not match it."""
    selector = only(custom_manifests, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    other_release = dict(only(custom_manifests, "Service")["metadata"]["labels"], **{"app.kubernetes.io/instance": "x"})
    assert not selector.items() <= other_release.items()


# --- notifications ------------------------------------------------------------------------------------------------

NOTIFICATION_DEFAULTS = (
    '[{"name": "ops", "format": "Slack", "urlSecretRef": {"name": "kvpolicy-hooks", "key": "slack"}},'
    ' {"name": "events", "urlSecretRef": {"name": "kvpolicy-hooks", "key": "cloudevents"}, "events": ["Decided"]}]'
)


def test_default_receivers_reach_the_operator_and_only_their_secret_is_readable(render: Renderer) -> None:
    from kvpolicy.notify.notifier import DeliverySettings, NotifierConfig

    manifests = render("--set-json", f"notifications.defaults={NOTIFICATION_DEFAULTS}")
    env = {entry["name"]: entry["value"] for entry in operator_container(manifests)["env"]}
    parsed = NotifierConfig.parse(env["KVPOLICY_NOTIFICATIONS"], env["KVPOLICY_NAMESPACE"], DeliverySettings())
    assert parsed.namespace == RELEASE_NAMESPACE
    assert [(spec.name, spec.format.value, spec.url_secret_ref.key) for spec in parsed.defaults] == [
        ("ops", "Slack", "slack"),
        ("events", "CloudEvents", "cloudevents"),
    ]
    assert env["KVPOLICY_NOTIFY_ATTEMPTS"] == "5"
    role = next(r for r in of_kind(manifests, "Role") if r["metadata"]["name"].endswith("-notifications"))
    assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["kvpolicy-hooks"], "verbs": ["get"]}
    ]
    assert ("", "secrets", "get") not in granted(operator_cluster_role(manifests)), "no other Secret"


def test_policy_secrets_grant_get_on_secrets_where_policies_are_reconciled(render: Renderer) -> None:
    cluster_wide = granted(operator_cluster_role(render("--set", "notifications.policySecrets=true")))
    assert {triple for triple in cluster_wide if triple[1] == "secrets"} == {("", "secrets", "get")}
    namespaced = render("--values", CUSTOM_VALUES, "--set", "notifications.policySecrets=true")
    assert ("", "secrets", "get") not in granted(operator_cluster_role(namespaced))
    assert all(("", "secrets", "get") in granted(role) for role in of_kind(namespaced, "Role"))


def test_referenced_secrets_are_read_only_when_the_value_grants_it(render: Renderer) -> None:
    reads = {("", "secrets", "get"), ("", "configmaps", "get")}
    assert not reads & granted(operator_cluster_role(render())), "off by default"
    cluster_wide = granted(operator_cluster_role(render("--set", "auth.readReferencedSecrets=true")))
    assert reads <= cluster_wide
    assert {t for t in cluster_wide if t[1] in ("secrets", "configmaps")} == reads, "get only: no list or watch"
    namespaced = render("--values", CUSTOM_VALUES, "--set", "auth.readReferencedSecrets=true")
    assert not reads & granted(operator_cluster_role(namespaced))
    assert all(reads <= granted(role) for role in of_kind(namespaced, "Role") if "-notifications" not in str(role))


def test_malformed_default_receivers_are_refused_at_install(render: Renderer) -> None:
    with pytest.raises(RenderError, match=re.escape("notifications.defaults.0: urlSecretRef is required")):
        render("--set-json", 'notifications.defaults=[{"name": "ops"}]')


@pytest.mark.parametrize(
    ("value", "group", "resource"),
    [
        ("leaderWorkerSet", "leaderworkerset.x-k8s.io", "leaderworkersets"),
        ("llmInferenceService", "serving.kserve.io", "llminferenceservices"),
    ],
)
def test_target_kinds_are_granted_only_when_enabled_and_only_the_verbs_used(
    render: Renderer, value: str, group: str, resource: str
) -> None:
    used = {(group, resource, verb) for verb in ("get", "list", "create", "patch", "delete")}
    assert documented_rbac()[f"namespaced, with `targets.{value}.enabled`"] == used, "the README's RBAC table"
    assert not {t for t in granted(operator_cluster_role(render())) if t[0] == group}, "off by default"
    enabled = f"targets.{value}.enabled=true"
    cluster_wide = granted(operator_cluster_role(render("--set", enabled)))
    assert {t for t in cluster_wide if t[0] == group} == used
    namespaced = render("--values", CUSTOM_VALUES, "--set", enabled)
    assert not used & granted(operator_cluster_role(namespaced)), "namespaced: in each watched namespace's Role"
    assert all(used <= granted(role) for role in of_kind(namespaced, "Role") if "-notifications" not in str(role))


def test_runbook_urls_follow_the_configured_pattern(render: Renderer) -> None:
    """monitoring-mixins' runbookURLPattern: the PrometheusRule's runbook links can point at a team's own runbooks;
    by default they are the repository's, as in monitoring/alerts.yaml."""
    alerts = yaml.safe_load((CHART_DIR / "files" / "alerts.yaml").read_text())
    shipped = {r["alert"]: r["annotations"]["runbook_url"] for g in alerts["groups"] for r in g["rules"]}

    def runbooks(*args: str) -> dict[str, str]:
        rule = only(render("--set", "prometheusRule.enabled=true", *args), "PrometheusRule")
        return {r["alert"]: r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]}

    assert runbooks() == shipped
    pattern = "https://wiki.example.com/runbooks/kvpolicy/%s"
    assert runbooks("--set", f"prometheusRule.runbookURLPattern={pattern}") == {
        name: f"https://wiki.example.com/runbooks/kvpolicy/{name.lower()}" for name in shipped
    }
    with pytest.raises(RenderError, match="runbookURLPattern: Does not match pattern"):
        render("--set", "prometheusRule.runbookURLPattern=https://wiki.example.com/kvpolicy")


def test_pod_monitor_scrapes_the_canaries_in_the_watched_namespaces(
    custom_manifests: list[Manifest], custom_values: dict[str, Any], render: Renderer
) -> None:
    """Issue 23 item 3: the canary's pods carry only kvpolicy's labels before the accuracy gate; the PodMonitor selects
    exactly those (not gate Jobs' pods) where the operator reconciles, on the port the target's template names."""
    monitor = only(custom_manifests, "PodMonitor")
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/managed-by": "kvpolicy", "kvpolicy.dev/role": "canary"}
    }
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": custom_values["watchNamespaces"]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    every = only(render("--set", "podMonitor.enabled=true,podMonitor.port=vllm"), "PodMonitor")
    assert every["spec"]["namespaceSelector"] == {"any": True}
    with pytest.raises(RenderError, match=re.escape("podMonitor.port: name the vLLM container's port")):
        render("--set", "podMonitor.enabled=true")


def test_aggregated_roles_let_view_read_and_edit_write_kvpolicies(
    default_manifests: list[Manifest], render: Renderer
) -> None:
    """Issue 23 item 12: who may view or edit a namespace may do the same with its KVPolicies (kubectl kvpolicy get,
    status; approve, pause, ...), through Kubernetes' aggregated view/edit/admin roles; read-only stays read-only."""
    roles = {
        r["metadata"]["name"]: r
        for r in of_kind(default_manifests, "ClusterRole")
        if r not in operator_rbac(default_manifests)
    }
    assert set(roles) == {"kvpolicy-view", "kvpolicy-edit"}
    aggregates = {
        name: {k for k, v in role["metadata"]["labels"].items() if "aggregate-to" in k and v == "true"}
        for name, role in roles.items()
    }
    prefix = "rbac.authorization.k8s.io/aggregate-to-"
    assert aggregates == {
        "kvpolicy-view": {prefix + "view", prefix + "edit", prefix + "admin"},
        "kvpolicy-edit": {prefix + "edit", prefix + "admin"},
    }
    kvp = "kvpolicy.dev"
    assert granted(roles["kvpolicy-view"]) == {
        (kvp, resource, verb) for resource in ("kvpolicies", "kvpolicies/status") for verb in ("get", "list", "watch")
    }
    assert granted(roles["kvpolicy-edit"]) == {
        (kvp, "kvpolicies", verb) for verb in ("create", "update", "patch", "delete", "deletecollection")
    }
    bindings = of_kind(default_manifests, "ClusterRoleBinding") + of_kind(default_manifests, "RoleBinding")
    assert not any(b["roleRef"]["name"] in roles for b in bindings), "they grant nothing by themselves"
    assert not [
        r
        for r in of_kind(render("--set", "aggregatedRoles.enabled=false"), "ClusterRole")
        if r not in operator_rbac([r])
    ]


def test_the_install_notes_recommend_watch_namespaces(render: Renderer, tmp_path: Path) -> None:
    """NOTES.txt, rendered through a copy of the chart that carries it as a ConfigMap (helm template skips NOTES)."""
    chart = tmp_path / CHART_DIR.name
    shutil.copytree(CHART_DIR, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "files" / "NOTES.txt")
    show = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n"
    show += '{{ tpl (.Files.Get "files/NOTES.txt") . | indent 4 }}\n'
    (chart / "templates" / "notes.yaml").write_text(show)

    def notes(*args: str) -> str:
        [config_map] = [m for m in render(*args, chart=chart) if m["metadata"]["name"] == "notes"]
        return " ".join(config_map["data"]["notes"].split())

    assert "For production, set watchNamespaces to the namespaces that serve vLLM" in notes()
    assert "For production" not in notes("--set", "watchNamespaces={llm}")
    assert "kvpolicy-view and kvpolicy-edit" in notes()
