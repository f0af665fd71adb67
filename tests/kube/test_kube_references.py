"""Credentials by reference: the Secret and ConfigMap keys of `gates.latency.prometheusAuth`, read through KubeApi,
and what a rollout does when one cannot be used (a condition with a specific reason, one Warning event, and the
rules of an unavailable provider). No message may carry a secret value."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from auth_proxy import Pki
from fake_kube import FakeKubeApi
from kvpolicy.analysis.checks import CheckVerdict
from kvpolicy.analysis.model import ProviderUnavailableError, Verdict
from kvpolicy.analysis.served import CANARY_CONFIG
from kvpolicy.api.v1alpha1 import GateVerdict, KVPolicy, PrometheusAuth
from kvpolicy.kube.api import CONFIG_MAPS, SECRETS, ApiError
from kvpolicy.kube.observe import LatencyAnalyser, PodView
from kvpolicy.kube.references import ReferenceReader, prometheus_credentials
from kvpolicy.rollout import builders
from kvpolicy.rollout.gates import accuracy, latency_probe
from kvpolicy.rollout.metric_checks import METRICS_CHECKS
from kvpolicy.rollout.rules import rollout_hash
from operator_helpers import Driver, live, make_policy
from pydantic import ValidationError

NAMESPACE = "llm"
TOKEN = "token-5d7e1c3b-do-not-print"
ROTATED = "token-rotated-9a0b-do-not-print"
PASSWORD = "password-8f2e-do-not-print"
SECRETS_SHOWN = (TOKEN, ROTATED, PASSWORD)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def secret(name: str, **data: str) -> dict[str, Any]:
    encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
    return {"metadata": {"name": name, "namespace": NAMESPACE}, "data": encoded}


def auth(**fields: Any) -> PrometheusAuth:
    return PrometheusAuth.model_validate(fields)


BEARER = auth(bearerTokenSecretRef={"name": "prom", "key": "token"})


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki.create(tmp_path / "pki")


async def resolve(api: FakeKubeApi, spec: PrometheusAuth, clock: Clock | None = None) -> Any:
    return await prometheus_credentials(ReferenceReader(api, clock=clock or Clock()), NAMESPACE, spec)


async def unavailable(api: FakeKubeApi, spec: PrometheusAuth) -> ProviderUnavailableError:
    with pytest.raises(ProviderUnavailableError) as caught:
        await resolve(api, spec)
    assert not any(value in caught.value.message for value in SECRETS_SHOWN)
    return caught.value


async def test_a_bearer_token_and_headers_become_request_headers_without_showing_the_token() -> None:
    api = FakeKubeApi()
    api.put(SECRETS, NAMESPACE, secret("prom", token=TOKEN + "\n"))  # `kubectl create secret --from-file` keeps it
    api.put(SECRETS, NAMESPACE, secret("tenant", org="team-llm"))
    spec = auth(
        bearerTokenSecretRef={"name": "prom", "key": "token"},
        headers=[
            {"name": "X-Scope-OrgID", "valueFrom": {"secretKeyRef": {"name": "tenant", "key": "org"}}},
            {"name": "X-Team", "value": "llm"},
        ],
    )
    resolved = await resolve(api, spec)
    headers = resolved.credentials.headers()
    assert headers == {"Authorization": f"Bearer {TOKEN}", "X-Scope-OrgID": "team-llm", "X-Team": "llm"}
    assert TOKEN not in repr(resolved.credentials) and TOKEN not in resolved.digest
    assert resolved.credentials.redact(f"echo {TOKEN}") == "echo ***"


async def test_basic_auth_from_two_keys() -> None:
    api = FakeKubeApi()
    api.put(SECRETS, NAMESPACE, secret("prom", username="kvpolicy", password=PASSWORD))
    spec = auth(
        basicAuth={"username": {"name": "prom", "key": "username"}, "password": {"name": "prom", "key": "password"}}
    )
    expected = "Basic " + base64.b64encode(f"kvpolicy:{PASSWORD}".encode()).decode()
    assert (await resolve(api, spec)).credentials.headers() == {"Authorization": expected}


async def test_a_missing_secret_key_or_forbidden_read_is_unavailable_with_its_own_reason() -> None:
    api = FakeKubeApi()
    missing = await unavailable(api, BEARER)
    assert (missing.reason, missing.message) == ("CredentialsSecretMissing", "Secret llm/prom not found")
    api.put(SECRETS, NAMESPACE, secret("prom", other=TOKEN))
    no_key = await unavailable(api, BEARER)
    assert (no_key.reason, no_key.message) == ("CredentialsKeyMissing", "Secret llm/prom has no key token")
    api.fail["get"] = ApiError(403, "Forbidden", 'secrets "prom" is forbidden')
    forbidden = await unavailable(api, BEARER)
    assert forbidden.reason == "CredentialsSecretUnreadable"
    assert (
        "cannot read Secret llm/prom: 403 Forbidden (the operator needs `get` on secrets in llm)" in forbidden.message
    )
    api.put(SECRETS, NAMESPACE, {"metadata": {"name": "prom"}, "data": {"token": "not base64!"}})
    garbled = await unavailable(api, BEARER)
    assert (garbled.reason, garbled.message) == (
        "CredentialsSecretUnreadable",
        "Secret llm/prom key token is not base64 of UTF-8 text",
    )
    api.put(SECRETS, NAMESPACE, secret("prom", token=f"{TOKEN}\nsecond line"))
    two_lines = await unavailable(api, BEARER)
    assert two_lines.reason == "CredentialsUnreadable" and "Secret llm/prom key token" in two_lines.message


async def test_a_rotated_or_created_secret_is_read_again_after_the_ttl_only() -> None:
    api, clock = FakeKubeApi(), Clock()
    reader = ReferenceReader(api, ttl_seconds=30, clock=clock)
    with pytest.raises(ProviderUnavailableError, match="not found"):
        await prometheus_credentials(reader, NAMESPACE, BEARER)
    api.put(SECRETS, NAMESPACE, secret("prom", token=TOKEN))
    clock.now = 29
    with pytest.raises(ProviderUnavailableError, match="not found"):  # the absence is kept for the TTL too
        await prometheus_credentials(reader, NAMESPACE, BEARER)
    clock.now = 31
    first = await prometheus_credentials(reader, NAMESPACE, BEARER)
    api.put(SECRETS, NAMESPACE, secret("prom", token=ROTATED))
    assert (await prometheus_credentials(reader, NAMESPACE, BEARER)).digest == first.digest
    gets = api.calls.count("get secrets")
    clock.now = 62
    rotated = await prometheus_credentials(reader, NAMESPACE, BEARER)
    assert rotated.digest != first.digest and rotated.credentials.headers()["Authorization"] == f"Bearer {ROTATED}"
    assert api.calls.count("get secrets") == gets + 1, "one read per TTL, not one per query"


async def test_tls_from_a_configmap_ca_and_a_secret_client_pair(pki: Pki) -> None:
    api = FakeKubeApi()
    api.put(CONFIG_MAPS, NAMESPACE, {"metadata": {"name": "ca"}, "data": {"ca.crt": pki.ca_cert.read_text()}})
    pair = {"tls.crt": pki.client_cert.read_text(), "tls.key": pki.client_key.read_text()}
    api.put(SECRETS, NAMESPACE, secret("client", **pair))
    tls = {
        "ca": {"configMap": {"name": "ca", "key": "ca.crt"}},
        "cert": {"secret": {"name": "client", "key": "tls.crt"}},
        "keySecret": {"name": "client", "key": "tls.key"},
    }
    context = (await resolve(api, auth(tls=tls))).credentials.ssl_context
    assert [ca["subject"] for ca in context.get_ca_certs()] == [((("commonName", "kvpolicy test CA"),),)]
    api.put(SECRETS, NAMESPACE, secret("client", **{**pair, "tls.key": pki.server_key.read_text()}))
    mismatch = await unavailable(api, auth(tls=tls))
    assert mismatch.reason == "CredentialsUnreadable"
    assert "Secret llm/client key tls.crt and the key in Secret llm/client key tls.key are not a PEM pair" in (
        mismatch.message
    )
    api.put(CONFIG_MAPS, NAMESPACE, {"metadata": {"name": "ca"}, "data": {"other": "x"}})
    assert (await unavailable(api, auth(tls=tls))).message == "ConfigMap llm/ca has no key ca.crt"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"headers": [{"name": "Authorization", "value": "Bearer x"}]}, "comes from bearerTokenSecretRef or basicAuth"),
        ({"headers": [{"name": "X-Scope-OrgID"}]}, "a header takes exactly one of value or valueFrom"),
        ({"headers": [{"name": "bad name", "value": "x"}]}, "String should match pattern"),
    ],
)
def test_bad_headers_are_refused_with_the_field_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        auth(**fields)


def policy_with_auth() -> KVPolicy:
    return make_policy(
        **{
            "gates.latency.provider": "Prometheus",
            "gates.latency.prometheusURL": "https://prometheus.example:9091",
            "gates.latency.prometheusAuth": {"bearerTokenSecretRef": {"name": "prom", "key": "token"}},
        }
    )


async def test_the_analyser_turns_a_missing_secret_into_provider_unavailable_for_every_check() -> None:
    analyser = LatencyAnalyser(references=ReferenceReader(FakeKubeApi()))
    policy = policy_with_auth()
    target = {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 8000}]}]}}}}
    pods = [PodView("c-0", "10.0.0.1", True, None, {})]
    results = await analyser.evaluate(policy, target, METRICS_CHECKS, pods, pods, 300)
    assert [result.check for result in results] == list(METRICS_CHECKS)
    for result in results:
        verdict = result.verdict
        assert (verdict.kind, verdict.reason) == (GateVerdict.PROVIDER_UNAVAILABLE, "CredentialsSecretMissing")
        assert verdict.message == f"Secret {policy.metadata['namespace']}/prom not found"
        assert verdict.needs_attention, "waiting will not create the Secret: said at once"
    await analyser.close()


def test_credential_references_do_not_restart_a_rollout() -> None:
    plain, with_auth = make_policy(), policy_with_auth()
    without = with_auth.spec.model_copy(deep=True)
    without.gates.latency.prometheus_auth = None
    assert rollout_hash(with_auth.spec) == rollout_hash(without)
    keyed = plain.spec.model_validate(
        {**plain.spec.to_k8s(), "vllmAuth": {"apiKeySecretRef": {"name": "k", "key": "t"}}}
    )
    assert rollout_hash(keyed) == rollout_hash(plain.spec)


def test_the_served_config_check_waits_with_the_credentials_reason_and_one_event() -> None:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 120}))
    driver.tick()
    driver.world.canary_up()
    error = ProviderUnavailableError("CredentialsSecretMissing", "Secret llm/prom not found")
    missing = (CheckVerdict(CANARY_CONFIG, Verdict.provider_unavailable(error)),)
    driver.tick(checks=missing)
    driver.tick(10, checks=missing)
    assert driver.phase == "CanaryStarting"
    assert driver.condition("CanaryConfigVerified") == ("Unknown", "CredentialsSecretMissing")
    assert driver.reasons().count("CredentialsSecretMissing") == 1
    driver.tick(111, checks=missing)
    assert driver.phase == "RollingBack", "the progress deadline applies, as for any unreadable provider"


def test_the_latency_analysis_holds_on_a_credentials_problem_with_one_event() -> None:
    driver = live(**{"gates.latency.inconclusiveDeadlineSeconds": 1000})
    message = "Prometheus at https://prom:9091 answered HTTP 401 Unauthorized; the credentials sent were refused"
    refused = Verdict.provider_unavailable(ProviderUnavailableError("PrometheusUnauthorized", message))
    driver.tick(60, latency_verdict=refused)
    driver.tick(60, latency_verdict=refused)
    assert driver.phase == "LatencyAnalysis"
    assert driver.condition("LatencyGatePassed") == ("Unknown", "PrometheusUnauthorized")
    assert driver.reasons().count("PrometheusUnauthorized") == 1


def test_the_gate_jobs_name_the_api_key_secret_and_never_the_key() -> None:
    spec = make_policy(**{"vllmAuth": {"apiKeySecretRef": {"name": "vllm-key", "key": "token"}}}).spec
    for command in (accuracy.command(spec, "http://c", "http://b"), latency_probe.command(spec, "", "")):
        assert command[-2:] == ["--api-key-env", builders.API_KEY_ENV]
    assert builders.api_key_env(spec) == [
        {"name": builders.API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "vllm-key", "key": "token"}}}
    ]
    assert builders.api_key_env(make_policy().spec) == []
    assert "--api-key-env" not in latency_probe.command(make_policy().spec, "", "")
