"""The metrics providers through an authenticating TLS reverse proxy on loopback: a real Prometheus (and a pod's
/metrics) behind a bearer token or basic auth, a tenant header, a private CA and a required client certificate.

Credentials come from files laid out as a mounted Secret; no secret value may appear in any message or log line.
"""

from __future__ import annotations

import base64
import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from auth_proxy import BODY_MARKER, AuthProxy, Pki, basic_authorization, prometheus_auth_spec
from kvpolicy.analysis.latency_check import run_check
from kvpolicy.analysis.model import LatencyGateConfig, ProviderUnavailableError, SideSelector
from kvpolicy.analysis.prometheus import PrometheusProvider
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.analysis.served import CANARY_CONFIG
from kvpolicy.api.v1alpha1 import GateVerdict, KVPolicy
from kvpolicy.credentials import CredentialsSource, SecretValue, TlsSource
from kvpolicy.kube.api import SECRETS as SECRETS_RESOURCE
from kvpolicy.kube.api import Resource
from kvpolicy.kube.observe import LatencyAnalyser
from kvpolicy.kube.references import ReferenceReader
from kvpolicy.rollout.metric_checks import LATENCY
from kvpolicy.rollout.step_types import PodView
from live_fleet import Fleet

pytestmark = pytest.mark.prometheus

TOKEN = "bearer-0f9e8d7c6b5a-do-not-print"
ROTATED = "bearer-rotated-1a2b3c4d-do-not-print"
WRONG = "bearer-wrong-77aa88bb-do-not-print"
PASSWORD = "basic-password-5e6f-do-not-print"
TENANT = {"X-Scope-OrgID": "team-llm"}
SECRETS = (TOKEN, ROTATED, WRONG, PASSWORD)
CONFIG = LatencyGateConfig(
    ttft_max_ratio=1.2, itl_max_ratio=1.2, window_seconds=600, min_requests=20, bake_seconds=0, interval_seconds=1
)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


def secret_dir(directory: Path, pki: Pki, **keys: str) -> Path:
    """A directory as the kubelet mounts a Secret: one file per key (values end with a newline, as `kubectl create
    secret --from-file` often leaves them), with the PKI's CA and client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in keys.items():
        (directory / key).write_text(value + "\n")
    shutil.copy(pki.ca_cert, directory / "ca.crt")
    shutil.copy(pki.client_cert, directory / "tls.crt")
    shutil.copy(pki.client_key, directory / "tls.key")
    return directory


@pytest_asyncio.fixture(scope="session")
async def proxied_prometheus(fleet: Fleet, pki: Pki) -> AsyncIterator[AuthProxy]:
    proxy = AuthProxy(fleet.prometheus.url, pki, f"Bearer {TOKEN}", TENANT)
    await proxy.start()
    yield proxy
    await proxy.stop()


@pytest.fixture
def no_secret_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.DEBUG):
        yield
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert not any(secret in logged for secret in SECRETS)


def pods(role: str, name: str) -> SideSelector:
    return SideSelector(role, "llm", pods=(name,))


async def test_a_check_passes_through_the_proxy_with_a_token_tenant_ca_and_client_certificate(
    proxied_prometheus: AuthProxy, pki: Pki, tmp_path: Path, no_secret_logged: None
) -> None:
    source = CredentialsSource.from_secret_dir(secret_dir(tmp_path, pki, token=TOKEN), headers=TENANT)
    forwarded = proxied_prometheus.forwarded
    async with PrometheusProvider(proxied_prometheus.url, credentials=source.open()) as provider:
        verdict = await run_check(provider, CONFIG, pods("canary", "m-canary-0"), pods("baseline", "m-baseline-0"))
    assert (verdict.kind, verdict.reason) == (GateVerdict.PASS, "WithinThresholds"), verdict.message
    assert proxied_prometheus.forwarded > forwarded  # the answers came through the proxy


async def test_basic_auth(fleet: Fleet, pki: Pki, tmp_path: Path, no_secret_logged: None) -> None:
    proxy = AuthProxy(fleet.prometheus.url, pki, basic_authorization("kvpolicy", PASSWORD), require_client_cert=False)
    await proxy.start()
    try:
        source = CredentialsSource.from_secret_dir(secret_dir(tmp_path, pki, username="kvpolicy", password=PASSWORD))
        async with PrometheusProvider(proxy.url, credentials=source.open()) as provider:
            assert await provider.query('count(up{pod="m-canary-0"})') == [1.0]
    finally:
        await proxy.stop()


async def test_a_rotated_token_is_read_again_without_a_restart(
    proxied_prometheus: AuthProxy, pki: Pki, tmp_path: Path, no_secret_logged: None
) -> None:
    directory = secret_dir(tmp_path, pki, token=TOKEN)
    credentials = CredentialsSource.from_secret_dir(directory, headers=TENANT).open()
    async with PrometheusProvider(proxied_prometheus.url, credentials=credentials) as provider:
        assert await provider.query("vector(1)") == [1.0]
        proxied_prometheus.expected_authorization = f"Bearer {ROTATED}"
        try:
            with pytest.raises(ProviderUnavailableError, match="credentials sent were refused"):
                await provider.query("vector(1)")
            (directory / "token").write_text(ROTATED + "\n")  # the kubelet updates the mounted Secret
            assert await provider.query("vector(1)") == [1.0]
        finally:
            proxied_prometheus.expected_authorization = f"Bearer {TOKEN}"


def _tls(pki: Pki, ca: Path | None = None, client_cert: bool = True, skip: bool = False) -> TlsSource:
    return TlsSource(
        ca_file=ca,
        cert_file=pki.client_cert if client_cert else None,
        key_file=pki.client_key if client_cert else None,
        insecure_skip_verify=skip,
    )


@pytest.mark.parametrize(
    ("case", "reason", "message"),
    [
        ("no token", "PrometheusUnauthorized", "HTTP 401 Unauthorized; it wants credentials and none were given"),
        ("wrong token", "PrometheusUnauthorized", "HTTP 401 Unauthorized; the credentials sent were refused"),
        ("no tenant header", "QueryRejected", "(HTTP 400 Bad Request)"),
        ("an untrusted CA", "PrometheusTLSError", "TLS certificate is not trusted"),
        ("the system's CAs", "PrometheusTLSError", "TLS certificate is not trusted"),
        ("no client certificate", "PrometheusUnreachable", "cannot reach Prometheus at https://127.0.0.1:"),
    ],
)
async def test_each_missing_or_wrong_credential_is_a_clear_provider_unavailable(
    proxied_prometheus: AuthProxy,
    pki: Pki,
    case: str,
    reason: str,
    message: str,
    tmp_path: Path,
    no_secret_logged: None,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(WRONG if case == "wrong token" else TOKEN)
    token = None if case == "no token" else SecretValue(file=token_file)
    tls = {
        "an untrusted CA": _tls(pki, ca=pki.other_ca_cert),
        "the system's CAs": _tls(pki),
        "no client certificate": _tls(pki, ca=pki.ca_cert, client_cert=False),
    }.get(case, _tls(pki, ca=pki.ca_cert))
    headers = {} if case == "no tenant header" else TENANT
    source = CredentialsSource(bearer_token=token, headers=headers, tls=tls)
    async with PrometheusProvider(proxied_prometheus.url, credentials=source.open()) as provider:
        with pytest.raises(ProviderUnavailableError) as raised:
            await provider.query("vector(1)")
    assert raised.value.reason == reason
    assert message in raised.value.message
    # The proxy's refusal quotes the Authorization header it got: none of it may reach the message.
    assert BODY_MARKER not in raised.value.message
    assert not any(secret in raised.value.message for secret in SECRETS)


async def test_insecure_skip_verify_trusts_any_certificate_only_when_asked(
    proxied_prometheus: AuthProxy, pki: Pki, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    source = CredentialsSource(
        bearer_token=SecretValue(file=token_file), headers=TENANT, tls=_tls(pki, ca=pki.other_ca_cert, skip=True)
    )
    async with PrometheusProvider(proxied_prometheus.url, credentials=source.open()) as provider:
        assert await provider.query("vector(1)") == [1.0]


async def test_the_scrape_provider_sends_the_api_key_to_the_pods(
    fleet: Fleet, pki: Pki, tmp_path: Path, no_secret_logged: None
) -> None:
    proxy = AuthProxy(fleet.pods["m-canary-0"].url, pki, f"Bearer {TOKEN}", require_client_cert=False)
    await proxy.start()
    try:
        side = SideSelector("canary", "llm", endpoints=(proxy.url,))
        source = CredentialsSource.from_secret_dir(secret_dir(tmp_path, pki, token=TOKEN))
        async with ScrapeProvider(credentials=source.open()) as provider:
            snapshot = await provider.latency_snapshot(side, 60, (0.5,))
        assert snapshot.series_found
        ca_only = CredentialsSource(tls=TlsSource(ca_file=pki.ca_cert))
        async with ScrapeProvider(credentials=ca_only.open()) as provider:
            with pytest.raises(ProviderUnavailableError) as raised:
                await provider.latency_snapshot(side, 60, (0.5,))
        assert raised.value.reason == "ScrapeFailed"
        assert "answered HTTP 401 Unauthorized; it wants credentials and none were given" in raised.value.message
        assert BODY_MARKER not in raised.value.message
    finally:
        await proxy.stop()


class SecretsOnly:
    """The one KubeApi verb the operator's ReferenceReader uses: get, over Secrets kept here."""

    def __init__(self) -> None:
        self.secrets: dict[str, dict[str, Any]] = {}

    def put(self, name: str, **data: str) -> None:
        encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
        self.secrets[name] = {"metadata": {"name": name, "namespace": "llm"}, "data": encoded}

    async def get(self, resource: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert (resource, namespace) == (SECRETS_RESOURCE, "llm")
        return self.secrets.get(name)


async def test_the_operator_reads_the_credentials_from_secrets_and_picks_up_a_rotated_token(
    proxied_prometheus: AuthProxy, pki: Pki, no_secret_logged: None
) -> None:
    """The operator's analyser, as it runs in a rollout: prometheusAuth's Secrets through its Kubernetes client, a
    wrong token refused by the proxy (ProviderUnavailable/PrometheusUnauthorized), then the fixed Secret used once the
    reader's TTL has passed, with no restart."""
    api, now = SecretsOnly(), [0.0]
    api.put("prometheus-reader", token=WRONG)
    client = {"ca.crt": pki.ca_cert, "tls.crt": pki.client_cert, "tls.key": pki.client_key}
    api.put("prometheus-client", **{key: path.read_text() for key, path in client.items()})
    latency = {
        "provider": "Prometheus",
        "prometheusURL": proxied_prometheus.url,
        "ttftMaxRatio": "1.2",
        "itlMaxRatio": "1.2",
        "windowSeconds": 600,
        "minRequests": 20,
        "prometheusAuth": prometheus_auth_spec(TENANT),
    }
    policy = KVPolicy.model_validate(
        {
            "metadata": {"name": "m-fp8", "namespace": "llm"},
            "spec": {
                "targetRef": {"name": "m"},
                "model": {"servedModelName": "m", "headDim": 128, "numLayers": 32, "maxModelLen": 8192},
                "workload": {"maxContextTokens": 8192},
                "gates": {"latency": latency},
            },
        }
    )
    container = {"name": "vllm", "ports": [{"containerPort": 8000}]}
    target = {"metadata": {"name": "m"}, "spec": {"template": {"spec": {"containers": [container]}}}}
    canary, baseline = [PodView("m-canary-0", "127.0.0.1", True)], [PodView("m-baseline-0", "127.0.0.1", True)]
    analyser = LatencyAnalyser(references=ReferenceReader(api, ttl_seconds=30, clock=lambda: now[0]))
    try:
        checks = (LATENCY, CANARY_CONFIG)
        for refused in await analyser.evaluate(policy, target, checks, canary, baseline, 600):
            verdict = refused.verdict
            assert (verdict.kind, verdict.reason) == (GateVerdict.PROVIDER_UNAVAILABLE, "PrometheusUnauthorized")
            assert "the credentials sent were refused" in verdict.message and BODY_MARKER not in verdict.message
        api.put("prometheus-reader", token=TOKEN)  # the fixed (rotated) Secret
        now[0] = 31
        (latency,) = await analyser.evaluate(policy, target, (LATENCY,), canary, baseline, 600)
        assert (latency.verdict.kind, latency.verdict.reason) == (GateVerdict.PASS, "WithinThresholds"), latency
        provider = await analyser.provider(policy)
        served = await provider.served(analyser.side(policy, target, "canary", canary))
        assert served.missing is None and served.configs, "vllm:cache_config_info through the proxy"
    finally:
        await analyser.close()
