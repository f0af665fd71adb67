"""The emulated API server refuses names and labels as kube-apiserver does: 422 Invalid, field by field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.validation import DNS1035_LABEL_ERROR, dns1035_label, dns1123_subdomain, label_value

Obj = dict[str, Any]


@pytest_asyncio.fixture(loop_scope="function")
async def http(devcluster: ThreadedDevCluster) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=devcluster.url) as session:
        yield session


def service(name: str, selector: dict[str, str] | None = None) -> Obj:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": selector or {"app": "x"}, "ports": [{"port": 80}]}}  # fmt: skip


def deployment(name: str, labels: dict[str, str]) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }


def job(name: str) -> Obj:
    pod = {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": {"template": {"spec": pod}}}


async def _post(http: aiohttp.ClientSession, path: str, body: Obj) -> tuple[int, Obj]:
    async with http.post(path, json=body) as response:
        return response.status, await response.json()


async def test_a_service_name_must_be_a_dns_1035_label(http: aiohttp.ClientSession, devcluster_namespace: str) -> None:
    path = f"/api/v1/namespaces/{devcluster_namespace}/services"
    code, status = await _post(http, path, service("llama-3.1-8b-canary-g1"))
    assert (code, status["reason"]) == (422, "Invalid")
    assert status["message"] == (
        f'Service "llama-3.1-8b-canary-g1" is invalid: metadata.name: Invalid value: "llama-3.1-8b-canary-g1": '
        f"{DNS1035_LABEL_ERROR}"
    )
    assert status["details"]["causes"][0]["field"] == "metadata.name"
    assert (await _post(http, path, service("7b-canary")))[0] == 422, "a letter first"
    assert (await _post(http, path, service("a" * 64)))[0] == 422
    assert (await _post(http, path, service("llama-3-1-8b-canary-g1")))[0] == 201


async def test_deployments_take_dns_subdomains_but_label_values_stop_at_63(
    http: aiohttp.ClientSession, devcluster_namespace: str
) -> None:
    path = f"/apis/apps/v1/namespaces/{devcluster_namespace}/deployments"
    assert (await _post(http, path, deployment("llama-3.1-8b-canary-g1", {"p": "llama-3.1-8b"})))[0] == 201
    code, status = await _post(http, path, deployment("long", {"p": "a" * 64}))
    assert code == 422
    fields = {cause["field"] for cause in status["details"]["causes"]}
    assert fields == {"metadata.labels", "spec.template.labels", "spec.selector.matchLabels"}
    assert "must be no more than 63 characters" in status["message"]
    code, status = await _post(http, path, deployment("bad-key", {"-x/y": "v"}))
    assert code == 422 and "prefix part" in status["message"]


async def test_a_job_name_longer_than_a_label_value_is_refused(
    http: aiohttp.ClientSession, devcluster_namespace: str
) -> None:
    path = f"/apis/batch/v1/namespaces/{devcluster_namespace}/jobs"
    code, status = await _post(http, path, job("j" * 64))
    assert code == 422 and status["details"]["causes"][0]["field"] == "spec.template.labels"
    assert (await _post(http, path, job("j" * 63)))[0] == 201


async def test_label_edits_are_validated_too(http: aiohttp.ClientSession, devcluster_namespace: str) -> None:
    path = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    assert (await _post(http, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}))[0] == 201
    headers = {"Content-Type": "application/merge-patch+json"}
    async with http.patch(f"{path}/c", json={"metadata": {"labels": {"k": "v" * 64}}}, headers=headers) as response:
        assert response.status == 422


async def test_generate_name_is_cut_to_58_characters(http: aiohttp.ClientSession, devcluster_namespace: str) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": f"{'g' * 250}."}}
    code, created = await _post(http, f"/api/v1/namespaces/{devcluster_namespace}/configmaps", body)
    assert code == 201 and len(created["metadata"]["name"]) == 63
    assert created["metadata"]["name"].startswith("g" * 58)


@pytest.mark.parametrize(
    ("value", "valid"),
    [("llama-3.1-8b", True), ("A_b.c", True), ("", True), ("-a", False), ("a" * 63, True), ("a" * 64, False)],
)
def test_label_values(value: str, valid: bool) -> None:
    assert (label_value(value) == []) is valid


def test_names() -> None:
    assert dns1123_subdomain("llama-3.1-8b") == [] and dns1035_label("llama-3.1-8b") != []
    assert dns1123_subdomain("a" * 254) == ["must be no more than 253 characters"]
    assert dns1035_label("9b") and not dns1035_label("b9")


def _pod(name: str, image: str = "i", secure: bool = False, pull_secret: str | None = None) -> Obj:
    container: Obj = {"name": "c", "image": image}
    spec: Obj = {"restartPolicy": "Never", "containers": [container]}
    if secure:
        spec["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        container["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    if pull_secret:
        spec["imagePullSecrets"] = [{"name": pull_secret}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def test_pod_security_admission_follows_the_namespace_label(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    path = f"/api/v1/namespaces/{devcluster_namespace}/pods"
    assert (await _post(http, path, _pod("open")))[0] == 201, "no label: privileged"
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    devcluster.patch("v1", "Namespace", devcluster_namespace, {"metadata": {"labels": labels}})
    code, status = await _post(http, path, _pod("bare"))
    assert (code, status["reason"]) == (403, "Forbidden")
    assert status["message"].startswith('pods "bare" is forbidden: violates PodSecurity "restricted:latest": ')
    assert 'allowPrivilegeEscalation != false (container "c" must set' in status["message"]
    assert (await _post(http, path, _pod("hardened", secure=True)))[0] == 201


def test_a_private_registry_needs_the_pods_pull_secret(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    devcluster.set_private_registry("private.example/", "creds")
    devcluster.create(
        {**_pod("anonymous", "private.example/tool:1"), "metadata": {"name": "anonymous", "namespace": ns}}
    )

    def waiting(pod: Obj) -> str | None:
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        reason: str | None = ((statuses[0].get("state") or {}).get("waiting") or {}).get("reason")
        return reason

    devcluster.wait_for("v1", "Pod", "anonymous", ns, lambda pod: waiting(pod) == "ImagePullBackOff", 10)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds", "namespace": ns}, "data": {}}
    devcluster.create(secret)
    pod = {
        **_pod("entitled", "private.example/tool:1", pull_secret="creds"),
        "metadata": {"name": "entitled", "namespace": ns},
    }
    pod["spec"]["containers"][0]["command"] = ["python", "-c", "pass"]
    devcluster.create(pod)
    done = devcluster.wait_for(
        "v1", "Pod", "entitled", ns, lambda p: (p.get("status") or {}).get("phase") == "Succeeded", 30
    )
    assert waiting(done) is None
