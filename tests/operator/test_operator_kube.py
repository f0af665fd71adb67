"""The operator's API client (kubernetes_asyncio) against the dev cluster's API server, and `kvpolicy run`'s command
line."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
from kvpolicy.analysis.model import ProviderUnavailableError
from kvpolicy.api.v1alpha1 import ConfigMapKeySelector, SecretKeySelector
from kvpolicy.kube.api import (
    DEPLOYMENTS,
    FIELD_MANAGER,
    JOBS,
    KVPOLICIES,
    NODES,
    PODS,
    SERVICES,
    ApiError,
    KubernetesApi,
)
from kvpolicy.kube.login import ClusterLogin
from kvpolicy.kube.references import ReferenceReader
from kvpolicy.runtime import run
from kvpolicy.runtime.handlers import DEFAULT_PROBE_IMAGE, OperatorOptions
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.cluster import kubeconfig_text
from operator_helpers import policy_spec, target_deployment


@pytest.mark.parametrize(("code", "retryable"), [(0, True), (409, True), (429, True), (503, True), (404, False),
                                                 (422, False), (403, False)])  # fmt: skip
def test_which_errors_are_worth_retrying(code: int, retryable: bool) -> None:
    assert ApiError(code, "Reason", "message").retryable is retryable


def kubeconfig_login(server: str, tmp_path: Path) -> ClusterLogin:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kubeconfig_text(server))
    return ClusterLogin.discover({"KUBECONFIG": str(kubeconfig)})


async def test_client_verbs_against_the_dev_cluster(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, kvpolicy_crd: None
) -> None:
    ns = devcluster_namespace
    api = await KubernetesApi.connect(ClusterLogin.discover(devcluster.environ()))
    try:
        body = target_deployment()
        body["metadata"] = {"name": "llama", "namespace": ns, "labels": {"team": "a"}}
        body["spec"]["template"]["spec"]["nodeSelector"] = {"kvpolicy.dev/node-pool": "cpu"}
        body["spec"]["replicas"] = 0
        assert await api.create(DEPLOYMENTS, ns, body) is True
        assert await api.create(DEPLOYMENTS, ns, body) is False, "AlreadyExists counts as done"
        assert await api.get(DEPLOYMENTS, ns, "missing") is None
        assert [d["metadata"]["name"] for d in await api.list_objects(DEPLOYMENTS, ns, "team=a")] == ["llama"]
        assert [d["metadata"]["name"] for d in await api.list_objects(DEPLOYMENTS, None, "team=a")] == ["llama"]
        assert await api.list_objects(DEPLOYMENTS, ns, "team=b") == []
        patched = await api.patch(DEPLOYMENTS, ns, "llama", {"metadata": {"labels": {"team": "b"}}})
        assert patched is not None and patched["metadata"]["labels"]["team"] == "b"
        stale = [{"op": "test", "path": "/metadata/labels/team", "value": "a"}]
        with pytest.raises(ApiError) as caught:
            await api.patch(DEPLOYMENTS, ns, "llama", stale, "json")
        assert caught.value.code == 422
        assert await api.patch(DEPLOYMENTS, ns, "missing", {"metadata": {}}) is None
        devcluster.fail_next(1, 500, method="GET", resource="deployments", namespace=ns)
        with pytest.raises(ApiError) as caught:
            await api.get(DEPLOYMENTS, ns, "llama")
        assert caught.value.retryable and caught.value.code == 500
        assert await api.delete(DEPLOYMENTS, ns, "llama") is True
        assert await api.delete(DEPLOYMENTS, ns, "llama") is False

        # The other kinds the operator reads and writes, each through its own generated API.
        assert [node["kind"] for node in await api.list_objects(NODES, None, "kvpolicy.dev/node-pool=cpu")] == ["Node"]
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "labels": {"team": "a"}}}
        service["spec"] = {"selector": {"app": "x"}, "ports": [{"port": 80}]}
        assert await api.create(SERVICES, ns, service) is True
        assert [s["metadata"]["name"] for s in await api.list_objects(SERVICES, ns, "team=a")] == ["s"]
        assert await api.delete(SERVICES, ns, "s") is True
        assert await api.list_objects(JOBS, ns) == [] and await api.list_objects(PODS, ns) == []
        policy = {"apiVersion": "kvpolicy.dev/v1alpha1", "kind": "KVPolicy", "metadata": {"name": "p"}}
        policy["spec"] = policy_spec()
        assert await api.create(KVPOLICIES, ns, policy) is True
        written = await api.patch(KVPOLICIES, ns, "p", {"status": {"phase": "Planning"}}, subresource="status")
        assert written is not None and written["status"] == {"phase": "Planning"}
        fetched = await api.get(KVPOLICIES, ns, "p")
        assert fetched is not None and fetched["status"] == {"phase": "Planning"}
        assert [p["metadata"]["name"] for p in await api.list_objects(KVPOLICIES, None)] == ["p"]
        event = {"metadata": {"generateName": "p."}, "involvedObject": {"kind": "KVPolicy", "name": "p"}}
        await api.post_event(ns, {"apiVersion": "v1", "kind": "Event", "reason": "Tested", **event})
        assert [e["reason"] for e in devcluster.list("v1", "Event", ns)] == ["Tested"]
        assert await api.delete(KVPOLICIES, ns, "p") is True
    finally:
        await api.close()
    writes = [r for r in devcluster.call(lambda: list(devcluster.cluster.api)) if r.method.value in ("POST", "PATCH")]
    assert writes and {r.params.get("fieldManager") for r in writes[-10:]} == {FIELD_MANAGER}


async def test_unreachable_server_is_a_retryable_error(tmp_path: Path) -> None:
    api = await KubernetesApi.connect(kubeconfig_login("http://127.0.0.1:9", tmp_path), timeout_seconds=2)
    try:
        with pytest.raises(ApiError) as caught:
            await api.get(DEPLOYMENTS, "ns", "x")
        assert caught.value.code == 0 and caught.value.retryable
    finally:
        await api.close()


async def test_the_environment_is_read_once_for_the_proxy_not_on_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubernetes_asyncio's session trusts the environment: aiohttp then reads ~/.netrc and the proxy variables in
    its executor's threads twice per request, which thousands of policies' passes queued behind (issue 28). The
    client's session does not; HTTP_PROXY (with its credentials) and NO_PROXY still decide, read at connect."""
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}'
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n")
        writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://user:secret@127.0.0.1:{port}")
    monkeypatch.setenv("NO_PROXY", "bypassed.invalid")
    try:
        api = await KubernetesApi.connect(kubeconfig_login("http://kube.invalid:6443", tmp_path), timeout_seconds=5)
        try:
            assert all(not client.rest_client.pool_manager.trust_env for client in api._clients)
            assert await api.get(DEPLOYMENTS, "ns", "x") is None, "the proxy's 404"
        finally:
            await api.close()
        [request] = seen
        assert request.startswith(b"GET http://kube.invalid:6443/apis/apps/v1/namespaces/ns/deployments/x")
        assert b"Proxy-Authorization: Basic dXNlcjpzZWNyZXQ=" in request  # user:secret

        bypassing = await KubernetesApi.connect(kubeconfig_login("http://bypassed.invalid:6443", tmp_path))
        try:
            with pytest.raises(ApiError) as caught:
                await bypassing.get(DEPLOYMENTS, "ns", "x")
            assert caught.value.code == 0 and len(seen) == 1, "NO_PROXY: straight to a host that does not resolve"
        finally:
            await bypassing.close()
    finally:
        server.close()


async def test_an_api_timeout_is_logged_with_its_name(tmp_path: Path) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(1)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    api = await KubernetesApi.connect(kubeconfig_login(f"http://127.0.0.1:{port}", tmp_path), timeout_seconds=0.2)
    try:
        with pytest.raises(ApiError) as caught:
            await api.get(DEPLOYMENTS, "ns", "x")
    finally:
        await api.close()
        server.close()
    assert str(caught.value).endswith("read deployments: TimeoutError")


@pytest.mark.parametrize("argv", [[], ["--namespace", "a", "--all-namespaces"], ["-A", "--metrics-port", "x"]])
def test_run_rejects_a_bad_command_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        run.main(argv)
    assert caught.value.code == 2
    assert "usage: kvpolicy run" in capsys.readouterr().err


def test_run_names_a_bad_environment_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPOLICY_POLL_SECONDS", "soon")
    with pytest.raises(SystemExit):
        run.main(["-A"])
    assert "KVPOLICY_POLL_SECONDS='soon' is not a number of seconds" in capsys.readouterr().err


def test_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_GATE_IMAGE", "gate:1")
    monkeypatch.setenv("KVPOLICY_IDLE_SECONDS", "30")
    monkeypatch.delenv("KVPOLICY_PROBE_IMAGE", raising=False)
    options = OperatorOptions.from_env(metrics_port=9090)
    config = options.step_config()
    assert (config.gate_image, config.idle_seconds, options.metrics_port) == ("gate:1", 30.0, 9090)
    assert config.probe_image == DEFAULT_PROBE_IMAGE
    monkeypatch.setenv("KVPOLICY_IDLE_SECONDS", "-1")
    with pytest.raises(ValueError, match="must be above 0"):
        OperatorOptions.from_env()


async def test_referenced_secret_and_configmap_keys_are_read_through_the_client(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    """What prometheusAuth names, read as the operator does (ReferenceReader over KubernetesApi): a Secret key, a
    ConfigMap key (the generated client's `config_map` methods), and a clear reason for one that is not there."""
    ns = devcluster_namespace
    token = base64.b64encode(b"token-value").decode()
    devcluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "prom", "namespace": ns},
                       "data": {"token": token}})  # fmt: skip
    devcluster.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ca", "namespace": ns},
                       "data": {"ca.crt": "PEM"}})  # fmt: skip
    api = await KubernetesApi.connect(ClusterLogin.discover(devcluster.environ()))
    try:
        reader = ReferenceReader(api)
        assert await reader.secret(ns, SecretKeySelector(name="prom", key="token")) == "token-value"
        assert await reader.config_map(ns, ConfigMapKeySelector(name="ca", key="ca.crt")) == "PEM"
        with pytest.raises(ProviderUnavailableError) as caught:
            await reader.secret(ns, SecretKeySelector(name="gone", key="token"))
        missing = (caught.value.reason, caught.value.message)
        assert missing == ("CredentialsSecretMissing", f"Secret {ns}/gone not found")
    finally:
        await api.close()
