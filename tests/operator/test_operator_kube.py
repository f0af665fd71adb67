"""The operator's HTTP API client against the dev cluster's API server, and the `kvpolicy run` command line."""

from __future__ import annotations

import pytest
from kvpolicy.controller import run
from kvpolicy.controller.handlers import DEFAULT_PROBE_IMAGE, OperatorOptions
from kvpolicy.controller.kube import DEPLOYMENTS, JOBS, KVPOLICIES, PODS, ApiError, Credentials, HttpKubeApi, Resource
from kvpolicy_dev.devcluster import ThreadedDevCluster
from operator_helpers import target_deployment


def test_resource_paths() -> None:
    assert PODS.path("ns", "p", "log") == "/api/v1/namespaces/ns/pods/p/log"
    assert JOBS.path("ns") == "/apis/batch/v1/namespaces/ns/jobs"
    assert KVPOLICIES.path(None) == "/apis/kvpolicy.dev/v1alpha1/kvpolicies"
    assert Resource("", "v1", "nodes").path(None, "n1") == "/api/v1/nodes/n1"


@pytest.mark.parametrize(("code", "retryable"), [(0, True), (409, True), (429, True), (503, True), (404, False),
                                                 (422, False), (403, False)])  # fmt: skip
def test_which_errors_are_worth_retrying(code: int, retryable: bool) -> None:
    assert ApiError(code, "Reason", "message").retryable is retryable


async def test_http_client_verbs_against_the_dev_cluster(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    api = HttpKubeApi(Credentials(server=devcluster.url, token="devcluster"))
    try:
        body = target_deployment()
        body["metadata"] = {"name": "llama", "namespace": ns, "labels": {"team": "a"}}
        body["spec"]["template"]["spec"]["nodeSelector"] = {"kvpolicy.dev/node-pool": "cpu"}
        body["spec"]["replicas"] = 0
        assert await api.create(DEPLOYMENTS, ns, body) is True
        assert await api.create(DEPLOYMENTS, ns, body) is False, "AlreadyExists counts as done"
        assert await api.get(DEPLOYMENTS, ns, "missing") is None
        assert [d["metadata"]["name"] for d in await api.list_objects(DEPLOYMENTS, ns, "team=a")] == ["llama"]
        assert await api.list_objects(DEPLOYMENTS, ns, "team=b") == []
        patched = await api.patch(DEPLOYMENTS, ns, "llama", {"metadata": {"labels": {"team": "b"}}})
        assert patched is not None and patched["metadata"]["labels"]["team"] == "b"
        assert await api.patch(DEPLOYMENTS, ns, "missing", {"metadata": {}}) is None
        devcluster.fail_next(1, 500, method="GET", resource="deployments", namespace=ns)
        with pytest.raises(ApiError) as caught:
            await api.get(DEPLOYMENTS, ns, "llama")
        assert caught.value.retryable and caught.value.code == 500
        assert await api.delete(DEPLOYMENTS, ns, "llama") is True
        assert await api.delete(DEPLOYMENTS, ns, "llama") is False
    finally:
        await api.close()


async def test_unreachable_server_is_a_retryable_error() -> None:
    api = HttpKubeApi(Credentials(server="http://127.0.0.1:9"), timeout_seconds=2)
    try:
        with pytest.raises(ApiError) as caught:
            await api.get(DEPLOYMENTS, "ns", "x")
        assert caught.value.code == 0 and caught.value.retryable
    finally:
        await api.close()


def test_http_servers_need_no_tls_context() -> None:
    assert Credentials(server="http://127.0.0.1:1").ssl_context() is False
    assert Credentials(server="https://k8s:443", insecure=True).ssl_context() is False


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
