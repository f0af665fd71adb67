"""The chart and the operator agree: its flags parse with `kvpolicy run`, its default Job images are the operator's,
and its RBAC allows every request the operator makes in a whole rollout (and nothing the operator never asks for)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import chart_helpers
import pytest
from chart_helpers import (
    REGISTRY,
    RELEASE_NAMESPACE,
    Manifest,
    Renderer,
    Triple,
    granted,
    of_kind,
    only,
    operator_container,
)
from kopf.testing import KopfRunner
from kvpolicy.runtime import handlers
from kvpolicy.runtime.run import _parser as run_parser
from kvpolicy_dev.devcluster import POOL_LABEL, SimulatorRunner, ThreadedDevCluster
from kvpolicy_dev.devcluster.apiserver import ApiPath, query_flag
from kvpolicy_dev.devcluster.kserve import crd as kserve_crd
from kvpolicy_dev.devcluster.leaderworkerset import crd as lws_crd

FIXED_IMAGE = "vllm-fp8-twolevel:rbac-test"
# Checked by admission (ownerReferences with blockOwnerDeletion), never requested: no request can show it is used.
ADMISSION_ONLY = {("kvpolicy.dev", "kvpolicies/finalizers", "update")}
# A pass starts from the policy its watch event or the previous pass's status write gave it; it GETs the policy only
# after a spec edit, a sleep of idleSeconds or more (a held phase, a long bake) or a released target, none of which
# this quick rollout has (runtime/reconciler.py).
TIMER_PASS_ONLY = {("kvpolicy.dev", "kvpolicies", "get")}


@pytest.mark.parametrize("manifests_fixture", ["default_manifests", "custom_manifests"])
def test_chart_flags_parse_with_kvpolicy_run(
    manifests_fixture: str, request: pytest.FixtureRequest, custom_values: dict[str, Any]
) -> None:
    manifests: list[Manifest] = request.getfixturevalue(manifests_fixture)
    container = operator_container(manifests)
    args = run_parser().parse_args(container["args"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert (args.liveness_port, args.metrics_port) == (ports["health"], ports["metrics"])
    if manifests_fixture == "default_manifests":
        assert args.all_namespaces and args.namespace is None
    else:
        assert args.namespace == custom_values["watchNamespaces"] and not args.all_namespaces
        assert args.verbose  # extraArgs: ["--verbose"]


def test_chart_default_job_images_are_the_operators_defaults(default_manifests: list[Manifest]) -> None:
    """Run with or without the chart, the operator starts the same gate and probe Jobs (the same images and tags; the
    chart takes them from the registry it requires)."""
    env = {entry["name"]: entry["value"] for entry in operator_container(default_manifests)["env"]}
    for variable, default in (
        ("KVPOLICY_GATE_IMAGE", handlers.DEFAULT_GATE_IMAGE),
        ("KVPOLICY_PROBE_IMAGE", handlers.DEFAULT_PROBE_IMAGE),
    ):
        assert env[variable] == f"{REGISTRY}/{default.rsplit('/', 1)[1]}"
    defaults = handlers.OperatorOptions()
    assert json.loads(env["KVPOLICY_GATE_RESOURCES"]) == defaults.gate_resources
    assert json.loads(env["KVPOLICY_PREFLIGHT_RESOURCES"]) == defaults.preflight_resources


# --- RBAC against a real rollout on the dev cluster ---------------------------------------------------------------

VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update"}


def requested(method: str, path: ApiPath, params: dict[str, str]) -> tuple[Triple, str | None] | None:
    """The RBAC (group, resource, verb) and namespace of a resource request; None for discovery."""
    if path.plural is None:
        return None
    resource = f"{path.plural}/{path.subresource}" if path.subresource else path.plural
    if method == "GET":
        verb = "watch" if query_flag(params.get("watch")) else "get" if path.name else "list"
    elif method == "DELETE":
        verb = "delete" if path.name else "deletecollection"
    else:
        verb = VERBS[method]
    return (path.group, resource, verb), path.namespace


# The other target kinds: their CRD (the controllers' stand-ins make their pods), the chart value granting them, the
# target made from the same vLLM container, and the Deployment rule such a rollout never uses.
DEPLOYMENT_RULES = {("apps", "deployments", verb) for verb in ("get", "list", "create", "patch", "delete")}
# A ReplicaRatio canary of a Deployment joins the users' Service by its pods' labels (issue 23 item 6): the only use.
POD_JOIN_RULES = {("", "pods", "patch")}


def leaderworkerset(namespace: str, pod_spec: dict[str, Any]) -> dict[str, Any]:
    template = {"metadata": {"labels": {"app": "llama"}}, "spec": pod_spec}
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "llama", "namespace": namespace},
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 1, "workerTemplate": template}}}  # fmt: skip


def llminferenceservice(namespace: str, pod_spec: dict[str, Any]) -> dict[str, Any]:
    main = {"name": "main", "image": pod_spec["containers"][0]["image"],
            "env": [{"name": "VLLM_ADDITIONAL_ARGS", "value": "--max-model-len 131072"}]}  # fmt: skip
    router = {"route": {"group": "llama", "weight": 100}}
    spec = {"model": {"uri": "hf://example/llama", "name": "llama"}, "replicas": 1,
            "template": {**pod_spec, "containers": [main]}, "router": router}  # fmt: skip
    return {"apiVersion": "serving.kserve.io/v1alpha2", "kind": "LLMInferenceService",
            "metadata": {"name": "llama", "namespace": namespace}, "spec": spec}  # fmt: skip


OTHER_KINDS: dict[str, tuple[Callable[[], dict[str, Any]], str, Callable[[str, dict[str, Any]], dict[str, Any]]]] = {
    "LeaderWorkerSet": (lws_crd, "leaderWorkerSet", leaderworkerset),
    "LLMInferenceService": (kserve_crd, "llmInferenceService", llminferenceservice),
}


def rollout_objects(namespace: str, kind: str = "Deployment") -> tuple[dict[str, Any], dict[str, Any]]:
    """A vLLM workload of `kind` on the H200 pool and a KVPolicy that takes it to FP8 on the fixed image."""
    labels = {"app": "llama"}
    container = {
        "name": "vllm",
        "image": "vllm:0.12",
        "args": ["serve", "llama", "--max-model-len", "131072"],
        "ports": [{"name": "http", "containerPort": 8000}],
    }
    pod_spec = {"nodeSelector": {POOL_LABEL: "h200"}, "containers": [container]}
    target = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    if kind != "Deployment":
        target = OTHER_KINDS[kind][2](namespace, pod_spec)
    policy = {
        "apiVersion": "kvpolicy.dev/v1alpha1",
        "kind": "KVPolicy",
        "metadata": {"name": "llama-fp8", "namespace": namespace},
        "spec": {
            "targetRef": {"name": "llama", "kind": kind, "apiVersion": target["apiVersion"]},
            "model": {"servedModelName": "llama", "headDim": 128, "numLayers": 32, "maxModelLen": 131072},
            "workload": {"maxContextTokens": 131072, "typicalContextTokens": 65536},
            "images": {"fp8Patched": FIXED_IMAGE},
            "gates": {"accuracy": {"maxSamples": 40}, "latency": {"enabled": False}},
            "rollout": {"progressDeadlineSeconds": 60, "bakeSeconds": 0},
        },
    }
    return target, policy


@pytest.fixture
def fixed_image_runner(devcluster: ThreadedDevCluster) -> Iterator[None]:
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({FIXED_IMAGE})))
    yield


def gateway_objects(namespace: str) -> list[dict[str, Any]]:
    """The baseline InferencePool of the target's pods and an HTTPRoute sending to it (traffic InferencePool)."""
    pool_ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama"}
    return [
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
         "metadata": {"name": "llama", "namespace": namespace},
         "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": [{"number": 8000}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": "llm", "namespace": namespace},
         "spec": {"parentRefs": [{"name": "gateway"}], "rules": [{"backendRefs": [pool_ref]}]}},
    ]  # fmt: skip


# Each target kind with the traffic it is rolled out with, and a Deployment behind an InferencePool.
CASES = [("Deployment", "ReplicaRatio"), ("Deployment", "InferencePool"), *((k, "ReplicaRatio") for k in OTHER_KINDS)]


@pytest.mark.parametrize(("kind", "traffic"), CASES)
def test_rbac_allows_exactly_what_the_operator_requests_in_a_rollout(
    kind: str,
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    fixed_image_runner: None,
    render: Renderer,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    traffic: str,
) -> None:
    """The operator, confined to one namespace as the chart runs it there, promotes a policy and then handles its
    deletion; every API request it made must be allowed by the chart's Role in that namespace plus its ClusterRole.
    InferencePool traffic: with gatewayAPI.enabled, the route's and the pools' rules are used, every one of them."""
    from kvpolicy.api import crd

    ns = devcluster_namespace
    routed = traffic == "InferencePool"
    enabled = ["--set", f"targets.{OTHER_KINDS[kind][1]}.enabled=true"] if kind in OTHER_KINDS else []
    enabled += ["--set", "gatewayAPI.enabled=true"] if routed else []
    manifests = render("--set", f"watchNamespaces={{{ns}}}", *enabled)
    container = operator_container(manifests)
    for entry in container["env"]:
        monkeypatch.setenv(entry["name"], entry["value"])
    monkeypatch.setenv("KVPOLICY_POLL_SECONDS", "0.2")
    monkeypatch.setenv("KVPOLICY_IDLE_SECONDS", "5")
    namespace_flags = [arg for arg in container["args"] if arg.startswith("--namespace=")]
    assert namespace_flags == [f"--namespace={ns}"]

    devcluster.apply(crd.crd_object())
    if kind in OTHER_KINDS:
        devcluster.apply(OTHER_KINDS[kind][0]())
    target, policy = rollout_objects(ns, kind)
    if kind == "LLMInferenceService":  # KServe routes a group through an HTTPRoute: no Gateway API, no group
        request.getfixturevalue("gateway_api")
    devcluster.create(target)
    if routed:
        request.getfixturevalue("gateway_api")
        for obj in gateway_objects(ns):
            devcluster.create(obj)
        policy["spec"]["rollout"].update(traffic="InferencePool", inferencePool={"httpRoute": "llm", "pool": "llama"})
    before = {id(request) for request in devcluster.call(lambda: list(devcluster.cluster.api))}
    # The operator's handlers live in a registry of their own, as `kvpolicy run` hands it to kopf.
    kopf_args = ["run", "--standalone", *namespace_flags]
    with KopfRunner(kopf_args, registry=handlers.registry, timeout=120) as runner:
        devcluster.create(policy)
        done = devcluster.wait_for(
            "kvpolicy.dev/v1alpha1",
            "KVPolicy",
            "llama-fp8",
            ns,
            lambda obj: obj.get("status", {}).get("phase") in {"Promoted", "RolledBack", "HeldBF16"},
            give_up_after=120,
        )
        devcluster.delete("kvpolicy.dev/v1alpha1", "KVPolicy", "llama-fp8", ns)
        devcluster.wait_deleted("kvpolicy.dev/v1alpha1", "KVPolicy", "llama-fp8", ns, give_up_after=60)
    assert runner.exception is None, runner.output
    assert done["status"]["phase"] == "Promoted", done["status"]

    made = [request for request in devcluster.call(lambda: list(devcluster.cluster.api)) if id(request) not in before]
    used: dict[Triple, set[str | None]] = {}
    for request in made:
        path = ApiPath.parse(request.url.path)
        parsed = requested(request.method.value, path, request.params) if path else None
        if parsed is not None and parsed[1] in (ns, None):
            used.setdefault(parsed[0], set()).add(parsed[1])

    [role] = [role for role in of_kind(manifests, "Role") if role["metadata"]["namespace"] == ns]
    cluster_wide, in_namespace = granted(chart_helpers.operator_cluster_role(manifests)), granted(role)
    denied = {
        triple: namespaces
        for triple, namespaces in used.items()
        if triple not in cluster_wide and not (triple in in_namespace and None not in namespaces)
    }
    assert denied == {}, "requests the chart's RBAC would refuse (None: cluster-wide)"
    unused = (
        (cluster_wide | in_namespace)
        - used.keys()
        - ADMISSION_ONLY
        - TIMER_PASS_ONLY
        - (DEPLOYMENT_RULES if kind in OTHER_KINDS else set())
        - (POD_JOIN_RULES if kind in OTHER_KINDS or routed else set())
    )
    assert unused == set(), "permissions the operator never used"
    subjects = only(manifests, "RoleBinding")["subjects"]
    assert subjects[0]["namespace"] == RELEASE_NAMESPACE
