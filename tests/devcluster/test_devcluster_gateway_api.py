"""The dev cluster serves HTTPRoute v1 and InferencePool v1 from their projects' own CRDs: over HTTP, objects are
defaulted as the upstream schemas say and refused where their schemas and CEL rules refuse them, with
kube-apiserver's wording, so the operator's route and pool writes are held to what a real API server would take."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException
from kvpolicy.rollout.traffic_routes import mirror_filter
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.gateway_api import gateway_api_crds

pytestmark = pytest.mark.usefixtures("gateway_api")

INFERENCE = ("inference.networking.k8s.io", "v1", "inferencepools")
ROUTES = ("gateway.networking.k8s.io", "v1", "httproutes")
JSON_PATCH = "application/json-patch+json"


def _api() -> kubernetes.client.CustomObjectsApi:
    kubernetes.config.load_kube_config()
    return kubernetes.client.CustomObjectsApi()


def _pool(name: str, **spec: Any) -> dict[str, Any]:
    body = {"selector": {"matchLabels": {"app": name}}, "targetPorts": [{"number": 8000}]}
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {**body, **spec}}  # fmt: skip


def _route(name: str, weights: dict[str, int]) -> dict[str, Any]:
    refs = [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool, "weight": weight}
        for pool, weight in weights.items()
    ]
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name},
        "spec": {"parentRefs": [{"name": "inference-gateway"}], "rules": [{"backendRefs": refs}]},
    }


def _create(resource: tuple[str, str, str], namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    group, version, plural = resource
    created: dict[str, Any] = _api().create_namespaced_custom_object(group, version, namespace, plural, body)
    return created


def _refusal(resource: tuple[str, str, str], namespace: str, body: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as raised:
        _create(resource, namespace, body)
    assert raised.value.status == 422, raised.value.body
    message: str = json.loads(raised.value.body)["message"]
    return message


def test_the_upstream_crds_are_the_tagged_releases() -> None:
    crds = {crd["spec"]["names"]["kind"]: crd for crd in gateway_api_crds()}
    assert crds["HTTPRoute"]["metadata"]["annotations"]["gateway.networking.k8s.io/bundle-version"] == "v1.6.1"
    assert crds["InferencePool"]["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    assert [v["name"] for v in crds["InferencePool"]["spec"]["versions"]] == ["v1"]


def test_an_inference_pool_is_defaulted_by_its_schema(devcluster_namespace: str) -> None:
    picker = {"name": "llama-epp", "port": {"number": 9002}}
    created = _create(INFERENCE, devcluster_namespace, _pool("llama", endpointPickerRef=picker))
    assert created["spec"]["appProtocol"] == "http"
    assert created["spec"]["endpointPickerRef"] == {
        "name": "llama-epp",
        "port": {"number": 9002},
        "group": "",
        "kind": "Service",
        "failureMode": "FailClose",
    }


def test_a_route_weighted_across_two_pools_is_admitted(devcluster_namespace: str) -> None:
    created = _create(ROUTES, devcluster_namespace, _route("llm", {"llama": 90, "llama-fp8": 10}))
    refs = created["spec"]["rules"][0]["backendRefs"]
    assert [(ref["name"], ref["weight"]) for ref in refs] == [("llama", 90), ("llama-fp8", 10)]
    # The upstream schema's defaults: the parent is a Gateway, the rule matches every path.
    assert created["spec"]["parentRefs"][0]["kind"] == "Gateway"
    assert created["spec"]["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]


def test_what_the_upstream_schemas_refuse_is_refused(devcluster_namespace: str) -> None:
    heavy = _route("heavy", {"llama": 1_000_001})
    assert "spec.rules[0].backendRefs[0].weight in body should be less than or equal to 1000000" in _refusal(
        ROUTES, devcluster_namespace, heavy
    )
    mirror = _route("mirror", {"llama": 100})
    mirror["spec"]["rules"][0]["filters"] = [{"type": "RequestMirror"}]
    assert "filter.requestMirror must be specified for RequestMirror filter.type" in _refusal(
        ROUTES, devcluster_namespace, mirror
    )
    twice = _pool("twice", targetPorts=[{"number": 8000}, {"number": 8000}])
    assert 'spec.targetPorts: Invalid value: "array": port number must be unique' in _refusal(
        INFERENCE, devcluster_namespace, twice
    )
    unselective = _pool("unselective", selector={"matchLabels": {}})
    assert "spec.selector.matchLabels in body should have at least 1 properties" in _refusal(
        INFERENCE, devcluster_namespace, unselective
    )
    portless = _pool("portless", endpointPickerRef={"name": "epp"})
    assert "port is required when kind is 'Service' or unspecified" in _refusal(
        INFERENCE, devcluster_namespace, portless
    )


def test_weights_move_by_a_json_patch_whose_test_guards_them(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    _create(ROUTES, devcluster_namespace, _route("llm", {"llama": 90, "llama-fp8": 10}))
    group, version, plural = ROUTES
    api = _api()
    guarded = [
        {"op": "test", "path": "/spec/rules/0/backendRefs/1/weight", "value": 10},
        {"op": "replace", "path": "/spec/rules/0/backendRefs/1/weight", "value": 50},
    ]
    api.patch_namespaced_custom_object(
        group, version, devcluster_namespace, plural, "llm", guarded, _content_type=JSON_PATCH
    )
    stored = devcluster.get("gateway.networking.k8s.io/v1", "HTTPRoute", "llm", devcluster_namespace)
    assert stored["spec"]["rules"][0]["backendRefs"][1]["weight"] == 50
    with pytest.raises(ApiException) as raised:  # the same patch again: its test no longer holds
        api.patch_namespaced_custom_object(
            group, version, devcluster_namespace, plural, "llm", copy.deepcopy(guarded), _content_type=JSON_PATCH
        )
    assert raised.value.status == 422


def test_the_readmes_pool_and_route_are_admitted_by_the_upstream_schemas(devcluster_namespace: str) -> None:
    """What a GIE or llm-d user starts from in the README's InferencePool section is valid as written."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", readme, flags=re.DOTALL)]
    kinds = {"InferencePool": INFERENCE, "HTTPRoute": ROUTES}
    found = [block for block in blocks if isinstance(block, dict) and block.get("kind") in kinds]
    assert sorted(block["kind"] for block in found) == ["HTTPRoute", "InferencePool"]
    for block in found:
        _create(kinds[block["kind"]], devcluster_namespace, block)


def test_the_operators_mirror_filter_is_admitted_by_the_upstream_schema(devcluster_namespace: str) -> None:
    route = _route("mirrored", {"llama": 1})
    route["spec"]["rules"][0]["filters"] = [mirror_filter("llama-fp8-canary-g1", 20)]
    created = _create(ROUTES, devcluster_namespace, route)
    assert created["spec"]["rules"][0]["filters"][0]["requestMirror"]["percent"] == 20
