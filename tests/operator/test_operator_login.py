"""Credentials: a service-account token rotated on disk, a 401 answered with fresh credentials, a kubeconfig exec
plugin, all against the dev cluster's API server with bearer tokens enforced (and behind TLS for the in-cluster
login, which is https only); and `kvpolicy run` without any credentials."""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from e2e_helpers import KVP, OperatorFactory, policy, target, until, wait_phase
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException
from kvpolicy.kube import cached
from kvpolicy.kube import login as login_module
from kvpolicy.kube.api import NODES, ApiError, KubernetesApi
from kvpolicy.kube.cached import CachedKubeApi
from kvpolicy.kube.leader import KubernetesLeaseStore, LeaseRecord
from kvpolicy.kube.login import ClusterLogin, CredentialsError, InCluster, KubeConfigFile, find_source
from kvpolicy.runtime.supervisor import ApiHealth, ApiProbe
from kvpolicy_dev.devcluster import ThreadedDevCluster
from tls_front import TlsFront

HOLD = {"workload.maxContextTokens": 4096, "workload.typicalContextTokens": 2048}


@pytest.fixture(scope="module")
def tls_front(devcluster: ThreadedDevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsFront]:
    port = urlsplit(devcluster.url).port
    assert port is not None
    with TlsFront(port, tmp_path_factory.mktemp("tls")) as front:
        yield front


@dataclass
class ServiceAccount:
    """A service-account volume as the kubelet mounts it, and the pod's environment pointing at the TLS front."""

    directory: Path
    environ: dict[str, str]

    def rotate(self, token: str) -> None:
        """Write a new token the way the kubelet does: a new file swapped in atomically."""
        fresh = self.directory / "token.new"
        fresh.write_text(token)
        fresh.replace(self.directory / "token")


@pytest.fixture
def service_account(tmp_path: Path, tls_front: TlsFront) -> ServiceAccount:
    directory = tmp_path / "serviceaccount"
    directory.mkdir()
    (directory / "ca.crt").write_bytes(tls_front.ca_path.read_bytes())
    (directory / "namespace").write_text("default")
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(tls_front.port)}
    account = ServiceAccount(directory, environ)
    account.rotate("sa-1")
    return account


@dataclass
class ExecPlugin:
    """A kubeconfig whose user runs a small script that prints an ExecCredential with the token in `token_file`."""

    kubeconfig: Path
    token_file: Path
    runs_file: Path
    expires_file: Path

    @property
    def runs(self) -> int:
        return len(self.runs_file.read_text().splitlines()) if self.runs_file.exists() else 0


PLUGIN = """\
import json, pathlib, sys
here = pathlib.Path(sys.argv[1])
with open(here / "runs", "a") as runs:
    runs.write("run\\n")
status = {"token": (here / "token").read_text()}
expires = here / "expires"
if expires.exists():
    status["expirationTimestamp"] = expires.read_text()
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}))
"""


@pytest.fixture
def exec_plugin(tmp_path: Path, devcluster: ThreadedDevCluster) -> ExecPlugin:
    (tmp_path / "plugin.py").write_text(PLUGIN)
    (tmp_path / "token").write_text("exec-1")
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(tmp_path / "plugin.py"), str(tmp_path)],
            "interactiveMode": "Never",
        }
    }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "dev", "cluster": {"server": devcluster.url}}],
        "users": [{"name": "plugin", "user": user}],
        "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": "plugin"}}],
        "current-context": "dev",
    }
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    return ExecPlugin(kubeconfig, tmp_path / "token", tmp_path / "runs", tmp_path / "expires")


def tokens_sent(devcluster: ThreadedDevCluster, since: int) -> list[str]:
    """The bearer tokens of the API requests made since request number `since` (see `request_count`)."""
    requests = devcluster.call(lambda: list(devcluster.cluster.api))
    return [str(request.headers.get("Authorization", "")).removeprefix("Bearer ") for request in requests[since:]]


def request_count(devcluster: ThreadedDevCluster) -> int:
    return devcluster.call(lambda: len(list(devcluster.cluster.api)))


# --- the service account -------------------------------------------------------------------------------------------


async def test_a_rotated_service_account_token_is_used_once_the_reread_period_passed(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, service_account: ServiceAccount
) -> None:
    devcluster.accept_tokens(frozenset({"sa-1", "sa-2"}))  # the kubelet rotates well before the old token expires
    login = ClusterLogin(InCluster(service_account.directory), service_account.environ, reread_seconds=0.2)
    api = await KubernetesApi.connect(login)
    try:
        before = request_count(devcluster)
        assert await api.list_objects(NODES, None)
        service_account.rotate("sa-2")
        assert await api.list_objects(NODES, None)  # within the period: the token read at start
        await asyncio.sleep(0.3)
        assert await api.list_objects(NODES, None)
    finally:
        await api.close()
    assert tokens_sent(devcluster, before) == ["sa-1", "sa-1", "sa-2"]


async def test_an_expired_service_account_token_is_read_again_after_the_401(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, service_account: ServiceAccount
) -> None:
    devcluster.accept_tokens(frozenset({"sa-1"}))
    login = ClusterLogin(InCluster(service_account.directory), service_account.environ)  # re-read after 60 s
    api = await KubernetesApi.connect(login)
    try:
        assert await api.list_objects(NODES, None)
        service_account.rotate("sa-2")
        devcluster.accept_tokens(frozenset({"sa-2"}))  # sa-1 expired
        before = request_count(devcluster)
        assert await api.list_objects(NODES, None)
        assert login.token == "sa-2"
    finally:
        await api.close()
    assert tokens_sent(devcluster, before) == ["sa-1", "sa-2"], "one 401, then the token on disk"


async def test_a_401_without_fresher_credentials_is_an_error_that_is_not_retried(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, service_account: ServiceAccount
) -> None:
    devcluster.accept_tokens(frozenset({"someone-else"}))
    api = await KubernetesApi.connect(ClusterLogin(InCluster(service_account.directory), service_account.environ))
    try:
        before = request_count(devcluster)
        with pytest.raises(ApiError) as caught:
            await api.list_objects(NODES, None)
    finally:
        await api.close()
    assert (caught.value.code, caught.value.reason, caught.value.retryable) == (401, "Unauthorized", False)
    assert tokens_sent(devcluster, before) == ["sa-1", "sa-1"], "one more try with the token read again"


async def test_the_lease_and_the_readiness_probe_read_the_token_again_after_a_401(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, service_account: ServiceAccount
) -> None:
    # They use the library's generated API directly: without this a leader would lose its Lease (15 s) to a revoked
    # token while waiting for the scheduled re-read (60 s).
    devcluster.accept_tokens(frozenset({"sa-1"}))
    login = ClusterLogin(InCluster(service_account.directory), service_account.environ)  # re-read after 60 s
    moment = datetime.datetime(2026, 12, 1, 1, 2, 3, tzinfo=datetime.UTC)
    async with ApiClient(await login.configuration()) as client:
        store = KubernetesLeaseStore(client, devcluster_namespace, "kvp-leader", login)
        probe = ApiProbe(client, ApiHealth(), login=login)
        assert await probe.check() is None and await store.get() is None
        before = request_count(devcluster)
        service_account.rotate("sa-2")
        devcluster.accept_tokens(frozenset({"sa-2"}))
        assert (await store.create(LeaseRecord("a", 15, moment, moment))).holder == "a"
        service_account.rotate("sa-3")
        devcluster.accept_tokens(frozenset({"sa-3"}))
        assert await probe.check() is None
        assert tokens_sent(devcluster, before) == ["sa-1", "sa-2", "sa-2", "sa-3"], "one 401 each, then the new token"
        devcluster.accept_tokens(frozenset({"someone-else"}))
        before = request_count(devcluster)
        with pytest.raises(ApiException) as caught:
            await store.get()
        assert caught.value.status == 401
        assert await probe.check() == "401"
    assert tokens_sent(devcluster, before) == ["sa-3"] * 4, "one more try each, with the token read again"


async def test_watches_resume_with_the_token_read_again_after_it_expired(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    service_account: ServiceAccount,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cached, "WATCH_SECONDS", 1)  # the server ends each watch after a second: it is resumed
    monkeypatch.setattr(cached, "RETRY_SECONDS", 0.1)
    devcluster.accept_tokens(frozenset({"sa-1"}))
    login = ClusterLogin(InCluster(service_account.directory), service_account.environ)
    api = CachedKubeApi(await KubernetesApi.connect(login), cached.operator_selections("kvpolicy.dev/policy"))
    try:
        await api.list_objects(NODES, None, "kvpolicy.dev/node-pool=h200")
        informer = api.informer(NODES, None)
        assert informer is not None
        await until(lambda: informer.synced, "the node informer to sync")
        service_account.rotate("sa-2")
        devcluster.accept_tokens(frozenset({"sa-2"}))
        before = request_count(devcluster)
        await until(lambda: "sa-2" in tokens_sent(devcluster, before), "a request with the new token", within=15)
        await until(lambda: informer.synced, "the node informer to sync again")
        watches = [r for r in devcluster.call(lambda: list(devcluster.cluster.api))[before:] if r.params.get("watch")]
        assert watches[-1].headers["Authorization"] == "Bearer sa-2"
    finally:
        await api.close()


# --- kubeconfig exec plugins ---------------------------------------------------------------------------------------


async def test_an_exec_plugin_logs_in_and_runs_again_after_a_401(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, exec_plugin: ExecPlugin
) -> None:
    devcluster.accept_tokens(frozenset({"exec-1"}))
    login = ClusterLogin.discover({"KUBECONFIG": str(exec_plugin.kubeconfig)})
    assert login.source == KubeConfigFile(str(exec_plugin.kubeconfig))
    api = await KubernetesApi.connect(login)
    try:
        before = request_count(devcluster)
        assert await api.list_objects(NODES, None)
        assert await api.list_objects(NODES, None)
        assert exec_plugin.runs == 1, "the credential is kept while it works"
        exec_plugin.token_file.write_text("exec-2")
        devcluster.accept_tokens(frozenset({"exec-2"}))
        assert await api.list_objects(NODES, None)
    finally:
        await api.close()
    assert exec_plugin.runs == 2
    assert tokens_sent(devcluster, before) == ["exec-1", "exec-1", "exec-1", "exec-2"]


async def test_credentials_that_cannot_be_reloaded_after_a_401_are_a_retryable_error(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, exec_plugin: ExecPlugin
) -> None:
    """An exec plugin failing (its identity provider down, say) is worth another try later, not the end of a loop."""
    devcluster.accept_tokens(frozenset({"exec-1"}))
    api = await KubernetesApi.connect(ClusterLogin.discover({"KUBECONFIG": str(exec_plugin.kubeconfig)}))
    try:
        assert await api.list_objects(NODES, None)
        devcluster.accept_tokens(frozenset({"exec-2"}))
        exec_plugin.token_file.unlink()  # the plugin fails from now on
        with pytest.raises(ApiError) as caught:
            await api.list_objects(NODES, None)
    finally:
        await api.close()
    assert (caught.value.reason, caught.value.retryable) == ("CredentialsUnavailable", True)
    assert "exec: process returned 1" in caught.value.message


def test_an_exec_credential_is_renewed_a_minute_before_it_expires_or_halfway_when_short_lived() -> None:
    now = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
    minutes = datetime.timedelta(minutes=1)
    assert login_module.renewal_time(now + 15 * minutes, now) == now + 14 * minutes
    assert login_module.renewal_time(now + minutes, now) == now + minutes / 2
    assert login_module.renewal_time(now - minutes, now) == now + login_module.MIN_RENEWAL, "never busy-looping"
    assert login_module.renewal_time(None, now) is None


async def test_a_short_lived_exec_credential_is_renewed_without_waiting_for_a_401(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, exec_plugin: ExecPlugin
) -> None:
    expiry = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(seconds=12)
    exec_plugin.expires_file.write_text(expiry.strftime("%Y-%m-%dT%H:%M:%SZ"))
    login = ClusterLogin.discover({"KUBECONFIG": str(exec_plugin.kubeconfig)})
    api = await KubernetesApi.connect(login)
    try:
        info = await login.connection_info()
        assert info.expiration == expiry and info.token == "exec-1", "kopf logs in again at the expiry"
        exec_plugin.token_file.write_text("exec-2")
        exec_plugin.expires_file.unlink()
        before = request_count(devcluster)
        await asyncio.sleep(3.5)  # renewal due halfway through the 12 s: after about 6 s
        assert await api.list_objects(NODES, None)
        await asyncio.sleep(3.5)
        assert await api.list_objects(NODES, None)
    finally:
        await api.close()
    assert tokens_sent(devcluster, before) == ["exec-1", "exec-2"]
    assert exec_plugin.runs == 2


async def test_kopf_asking_again_for_the_credentials_it_has_gets_fresh_ones(exec_plugin: ExecPlugin) -> None:
    """kopf calls the login handler again after a 401 or at the expiry: the plugin runs again then, not before."""
    login = ClusterLogin.discover({"KUBECONFIG": str(exec_plugin.kubeconfig)})
    first = await login.connection_info()
    exec_plugin.token_file.write_text("exec-2")
    second = await login.connection_info()
    assert (first.token, second.token, exec_plugin.runs) == ("exec-1", "exec-2", 2)
    assert (first.server, first.scheme) == (second.server, "Bearer")


# --- finding credentials -------------------------------------------------------------------------------------------


def test_a_pod_uses_its_service_account_and_elsewhere_the_kubeconfig(tmp_path: Path) -> None:
    assert find_source({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == InCluster(login_module.SERVICE_ACCOUNT_DIR)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("{}")
    both = f"{tmp_path / 'missing'}{os.pathsep}{kubeconfig}"
    assert find_source({"KUBECONFIG": both}) == KubeConfigFile(both)


def test_no_credentials_say_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match=r"KUBERNETES_SERVICE_HOST is not set .* no kubeconfig at .*missing"):
        find_source({"KUBECONFIG": str(tmp_path / "missing")})


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("kind: Config\nclusters: []\ncontexts: []\nusers: []\n", "current-context"),
        (": not yaml: [", "cannot load the kubeconfig"),
    ],
)
async def test_a_broken_kubeconfig_is_one_clear_error(tmp_path: Path, content: str, says: str) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(content)
    with pytest.raises(CredentialsError, match=f"cannot load the kubeconfig {kubeconfig}: .*") as caught:
        await ClusterLogin.discover({"KUBECONFIG": str(kubeconfig)}).configuration()
    assert says in str(caught.value)


async def test_a_failing_exec_plugin_is_one_clear_error(exec_plugin: ExecPlugin) -> None:
    exec_plugin.token_file.unlink()  # the script fails
    with pytest.raises(CredentialsError, match=r"cannot load the kubeconfig .*exec: process returned 1"):
        await ClusterLogin.discover({"KUBECONFIG": str(exec_plugin.kubeconfig)}).configuration()


def run_without_credentials(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env.update(HOME=str(tmp_path), **extra)
    argv = [sys.executable, "-m", "kvpolicy", "run", "-A", "--liveness-port", "0", "--metrics-port", "0"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_kvpolicy_run_without_credentials_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    done = run_without_credentials(tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("kvpolicy run: no Kubernetes credentials: KUBERNETES_SERVICE_HOST is not set")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    broken = tmp_path / "broken"
    broken.write_text(": not yaml: [")
    done = run_without_credentials(tmp_path, KUBECONFIG=str(broken))
    assert done.returncode == 1 and done.stderr.startswith(f"kvpolicy run: cannot load the kubeconfig {broken}:")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


# --- the operator (kopf and its client) ----------------------------------------------------------------------------


def test_the_operator_runs_on_an_exec_plugin_kubeconfig(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    exec_plugin: ExecPlugin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    monkeypatch.setenv("KUBECONFIG", str(exec_plugin.kubeconfig))
    devcluster.accept_tokens(frozenset({"exec-1"}))
    before = request_count(devcluster)
    with operator():
        devcluster.create(policy(ns, **HOLD))
        done = wait_phase(devcluster, ns, {"HeldBF16"})
    assert done["status"]["decision"]["reason"] == "BelowDecodeBreakEven"
    sent = set(tokens_sent(devcluster, before))
    assert sent == {"exec-1"}, "kopf's requests and the operator's carried the plugin's token, and only it"
    assert exec_plugin.runs == 1, "kopf's login and the operator's client share one credential"


def test_the_operator_keeps_working_when_its_service_account_token_is_rotated(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    service_account: ServiceAccount,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    devcluster.create(target(ns, name="mistral"))
    monkeypatch.delenv("KUBECONFIG")
    for key, value in service_account.environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(login_module, "SERVICE_ACCOUNT_DIR", service_account.directory)
    devcluster.accept_tokens(frozenset({"sa-1"}))
    with operator() as runner:
        devcluster.create(policy(ns, "first", **HOLD))
        wait_phase(devcluster, ns, {"HeldBF16"}, name="first")
        service_account.rotate("sa-2")
        devcluster.accept_tokens(frozenset({"sa-2"}))  # sa-1 expired while the operator runs
        before = request_count(devcluster)
        devcluster.create(policy(ns, "second", **{"targetRef.name": "mistral", **HOLD}))
        done = wait_phase(devcluster, ns, {"HeldBF16"}, name="second")
    assert done["status"]["decision"]["reason"] == "BelowDecodeBreakEven"
    sent = tokens_sent(devcluster, before)
    assert "sa-1" in sent and sent[-1] == "sa-2", "a 401, then the token read again from disk"
    assert "Traceback" not in runner.output
    assert devcluster.get(*KVP, "second", ns)["metadata"]["finalizers"], "kopf, too, wrote with the new token"
