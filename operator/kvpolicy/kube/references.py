"""Credentials the spec references, read from the cluster: `gates.latency.prometheusAuth`'s Secret and ConfigMap keys.

The operator reads them through `KubeApi` when it queries Prometheus, keeps each object for `ttl_seconds` (so a
rotated Secret is used within that time, without a restart and without a read on every query), and builds
`Credentials` whose values live only in memory and in request headers. A Secret or key it cannot use is a
`ProviderUnavailableError` with a specific reason (CredentialsSecretMissing, CredentialsKeyMissing,
CredentialsSecretUnreadable) naming the object and key, never the value: the latency analysis then treats it as any
unavailable provider.

The vLLM API key (`spec.vllmAuth`) is not read here: the gate Jobs get it as an env var from the Secret, and vLLM
0.32 checks it on /v1/* only, so the operator's own reads of the pods' /metrics need none.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import SecretStr

from kvpolicy.analysis.model import ProviderUnavailableError
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.api.v1alpha1 import ConfigMapKeySelector, PrometheusAuth, SecretKeySelector, SecretOrConfigMap
from kvpolicy.credentials import Credentials, CredentialsError, CredentialsSource, SecretValue, tls_context_from_pem
from kvpolicy.kube.api import CONFIG_MAPS, SECRETS, ApiError, KubeApi, Obj, Resource

DEFAULT_TTL_SECONDS = 30.0


@dataclass
class ReferenceReader:
    """Reads Secret and ConfigMap keys by reference, keeping each object (or its absence) for `ttl_seconds`."""

    api: KubeApi
    ttl_seconds: float = DEFAULT_TTL_SECONDS
    clock: Callable[[], float] = time.monotonic
    _objects: dict[tuple[str, str, str], tuple[float, Obj | None]] = field(default_factory=dict)

    async def _object(self, resource: Resource, namespace: str, name: str, kind: str) -> Obj:
        key = (resource.plural, namespace, name)
        now = self.clock()
        cached = self._objects.get(key)
        if cached is None or cached[0] <= now:
            try:
                found = await self.api.get(resource, namespace, name)
            except ApiError as error:
                raise ProviderUnavailableError(
                    AnalysisReason.CREDENTIALS_SECRET_UNREADABLE,
                    f"cannot read {kind} {namespace}/{name}: {error.code} {error.reason} (the operator needs `get` on "
                    f"{resource.plural} in {namespace})",
                ) from None
            cached = (now + self.ttl_seconds, found)
            self._objects[key] = cached
        if cached[1] is None:
            raise ProviderUnavailableError(
                AnalysisReason.CREDENTIALS_SECRET_MISSING, f"{kind} {namespace}/{name} not found"
            )
        return cached[1]

    async def secret(self, namespace: str, ref: SecretKeySelector) -> str:
        """The text of a Secret key (base64-decoded)."""
        secret = await self._object(SECRETS, namespace, ref.name, "Secret")
        encoded = (secret.get("data") or {}).get(ref.key)
        if encoded is None:
            raise ProviderUnavailableError(
                AnalysisReason.CREDENTIALS_KEY_MISSING, f"Secret {namespace}/{ref.name} has no key {ref.key}"
            )
        try:
            return base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise ProviderUnavailableError(
                AnalysisReason.CREDENTIALS_SECRET_UNREADABLE,
                f"Secret {namespace}/{ref.name} key {ref.key} is not base64 of UTF-8 text",
            ) from None

    async def config_map(self, namespace: str, ref: ConfigMapKeySelector) -> str:
        config_map = await self._object(CONFIG_MAPS, namespace, ref.name, "ConfigMap")
        value = (config_map.get("data") or {}).get(ref.key)
        if value is None:
            raise ProviderUnavailableError(
                AnalysisReason.CREDENTIALS_KEY_MISSING, f"ConfigMap {namespace}/{ref.name} has no key {ref.key}"
            )
        return str(value)

    async def pem(self, namespace: str, source: SecretOrConfigMap) -> str:
        if source.secret is not None:
            return await self.secret(namespace, source.secret)
        assert source.config_map is not None  # the model's rule: exactly one
        return await self.config_map(namespace, source.config_map)


def _origin(namespace: str, source: SecretKeySelector | SecretOrConfigMap | None) -> str:
    if isinstance(source, SecretOrConfigMap):
        if source.config_map is not None:
            return f"ConfigMap {namespace}/{source.config_map.name} key {source.config_map.key}"
        source = source.secret
    return f"Secret {namespace}/{source.name} key {source.key}" if source is not None else "nowhere"


@dataclass(frozen=True)
class ResolvedCredentials:
    """Opened credentials and a digest of everything they were built from (to see a rotation; never shown)."""

    credentials: Credentials
    digest: str


async def prometheus_credentials(reader: ReferenceReader, namespace: str, auth: PrometheusAuth) -> ResolvedCredentials:
    """The credentials `auth` references, read now (within the reader's TTL); ProviderUnavailableError otherwise."""
    parts: list[str] = []

    async def secret(ref: SecretKeySelector) -> SecretValue:
        text = await reader.secret(namespace, ref)
        parts.append(text)
        return SecretValue(value=SecretStr(text), origin=_origin(namespace, ref))

    bearer = await secret(auth.bearer_token_secret_ref) if auth.bearer_token_secret_ref else None
    username = await secret(auth.basic_auth.username) if auth.basic_auth else None
    password = await secret(auth.basic_auth.password) if auth.basic_auth else None
    plain = {header.name: header.value for header in auth.headers if header.value is not None}
    secret_headers = {
        header.name: await secret(header.value_from.secret_key_ref)
        for header in auth.headers
        if header.value_from is not None
    }
    tls = auth.tls
    ca = await reader.pem(namespace, tls.ca) if tls and tls.ca else None
    cert = await reader.pem(namespace, tls.cert) if tls and tls.cert else None
    key = await reader.secret(namespace, tls.key_secret) if tls and tls.key_secret else None
    insecure = bool(tls and tls.insecure_skip_verify)
    parts += [ca or "", cert or "", key or "", str(insecure), repr(sorted(plain.items()))]
    where = {
        "ca": _origin(namespace, tls.ca if tls else None),
        "cert": _origin(namespace, tls.cert if tls else None),
        "key": _origin(namespace, tls.key_secret if tls else None),
    }
    try:
        context = tls_context_from_pem(ca, cert, SecretStr(key) if key is not None else None, insecure, where)
        source = CredentialsSource(
            bearer_token=bearer, username=username, password=password, headers=plain, secret_headers=secret_headers
        )
        credentials = Credentials(source, context)
        credentials.headers()  # every value is usable (one line, not empty)
    except CredentialsError as error:
        raise ProviderUnavailableError(AnalysisReason.CREDENTIALS_UNREADABLE, str(error)) from None
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return ResolvedCredentials(credentials, digest)
