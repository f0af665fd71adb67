"""Where the API server is and how to authenticate, from kubernetes_asyncio's own loaders.

In a pod: the service account (token file and CA the kubelet mounts). Elsewhere: the kubeconfig named by KUBECONFIG
(else ~/.kube/config), with everything the library's loader understands: tokens, token files, client certificates,
exec plugins (EKS, GKE, AKS, OIDC logins). One `ClusterLogin` serves both kopf (its login handler) and the operator's
own client, so both authenticate the same way and both recover from rotated credentials:

- the service-account token file is re-read every `reread_seconds` (60 s, as client-go does): the kubelet rotates it
  on disk well before the old one expires;
- an exec plugin runs again when its credential's `expirationTimestamp` is near (the library caches it until then);
- a 401 makes the caller `refresh()`: the token file is read again, the kubeconfig reloaded, the exec plugin re-run.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kopf
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import load_incluster_config, load_kube_config

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
DEFAULT_KUBECONFIG = "~/.kube/config"
TOKEN_REREAD_SECONDS = 60.0
# Run an exec plugin again this long before its credential expires, so no request carries an expired token; a short-
# lived credential (under two minutes) halfway through its life instead, and never sooner than MIN_RENEWAL.
EXPIRY_LEEWAY = datetime.timedelta(seconds=60)
MIN_RENEWAL = datetime.timedelta(seconds=5)

Answer = TypeVar("Answer")


class CredentialsError(Exception):
    """No usable credentials: the message says what was looked for and what to do."""


@dataclass(frozen=True)
class InCluster:
    service_account_dir: Path

    def describe(self) -> str:
        return f"the service account in {self.service_account_dir}"


@dataclass(frozen=True)
class KubeConfigFile:
    paths: str  # KUBECONFIG's value: one path, or several joined with ':'

    def describe(self) -> str:
        return f"the kubeconfig {self.paths}"


Source = InCluster | KubeConfigFile


def find_source(environ: Mapping[str, str] | None = None, service_account_dir: Path | None = None) -> Source:
    """In a pod (KUBERNETES_SERVICE_HOST set) the service account, else the kubeconfig; CredentialsError if neither."""
    environ = os.environ if environ is None else environ
    if environ.get(SERVICE_HOST_ENV):
        return InCluster(service_account_dir or SERVICE_ACCOUNT_DIR)
    paths = environ.get("KUBECONFIG") or DEFAULT_KUBECONFIG
    if not any(Path(path).expanduser().is_file() for path in paths.split(os.pathsep) if path):
        raise CredentialsError(
            f"no Kubernetes credentials: {SERVICE_HOST_ENV} is not set (not running in a pod) and there is no "
            f"kubeconfig at {paths}; set KUBECONFIG to a kubeconfig file, or run in a pod with a service account"
        )
    return KubeConfigFile(paths)


class ClusterLogin:
    """Loads credentials into one kubernetes_asyncio `Configuration` and keeps them fresh (see the module doc)."""

    def __init__(
        self, source: Source, environ: Mapping[str, str] | None = None, reread_seconds: float = TOKEN_REREAD_SECONDS
    ) -> None:
        self.source = source
        self.reread_seconds = reread_seconds
        self._environ = dict(os.environ if environ is None else environ)
        self._configuration: Configuration | None = None
        self._loaded_at = 0.0
        self._expires_at: datetime.datetime | None = None  # an exec plugin's credential expiry
        self._renew_at: datetime.datetime | None = None
        self._lock = asyncio.Lock()
        self._handed_to_kopf = False
        self._kopf_token: str | None = None

    @classmethod
    def discover(cls, environ: Mapping[str, str] | None = None) -> ClusterLogin:
        return cls(find_source(environ), environ)

    async def configuration(self) -> Configuration:
        """The live configuration (loaded on first use); its token is refreshed before requests when due."""
        if self._configuration is None:
            configuration = Configuration()
            await self._load(configuration)
            configuration.refresh_api_key_hook = self._before_request
            self._configuration = configuration
        return self._configuration

    @property
    def token(self) -> str | None:
        """The bearer token requests carry now (without the "Bearer " prefix), if any."""
        if self._configuration is None:
            return None
        return _bare_token(self._configuration.api_key.get("BearerToken"))

    async def refresh(self, rejected_token: str | None = None) -> None:
        """Load the credentials again (after a 401). When `rejected_token` is given and the current token already
        differs from it, another request refreshed meanwhile and nothing is loaded."""
        configuration = await self.configuration()
        async with self._lock:
            if rejected_token is not None and self.token != rejected_token:
                return
            await self._load(configuration)

    async def once_more_after_401(self, request: Callable[[], Awaitable[Answer]]) -> Answer:
        """`request()` through the library's generated API; after a 401 the credentials are loaded again (unless
        another request already did) and it is made once more. For clients outside `KubernetesApi` (the Lease, the
        readiness probe), which would otherwise wait for the next scheduled re-read."""
        rejected_token = self.token
        try:
            return await request()
        except ApiException as error:
            if error.status != 401:
                raise
        await self.refresh(rejected_token)
        return await request()

    async def connection_info(self) -> kopf.ConnectionInfo:
        """Credentials for kopf, which calls its login handlers at start, at their expiration and after a 401: when
        kopf asks again for what it already has, those failed or expired, so they are loaded again."""
        configuration = await self.configuration()
        if self._handed_to_kopf and self.token == self._kopf_token:
            await self.refresh(rejected_token=self._kopf_token)
        self._handed_to_kopf, self._kopf_token = True, self.token
        return kopf.ConnectionInfo(
            server=str(configuration.host),
            ca_path=configuration.ssl_ca_cert,
            insecure=not configuration.verify_ssl,
            scheme="Bearer" if self._kopf_token else None,
            token=self._kopf_token,
            certificate_path=configuration.cert_file,
            private_key_path=configuration.key_file,
            expiration=self._expires_at,
        )

    def _due(self) -> bool:
        if self._renew_at is not None and datetime.datetime.now(datetime.UTC) >= self._renew_at:
            return True
        return isinstance(self.source, InCluster) and time.monotonic() - self._loaded_at >= self.reread_seconds

    async def _before_request(self, configuration: Configuration) -> None:
        if self._due():
            async with self._lock:
                if self._due():  # not already done by a request that held the lock
                    await self._load(configuration)

    async def _load(self, configuration: Configuration) -> None:
        try:
            if isinstance(self.source, InCluster):
                directory = self.source.service_account_dir
                load_incluster_config(  # type: ignore[no-untyped-call]  # the library leaves it unannotated
                    client_configuration=configuration,
                    try_refresh_token=False,  # re-reading is done here, on a schedule and after 401s
                    token_filename=str(directory / "token"),
                    cert_filename=str(directory / "ca.crt"),
                    environ=self._environ,
                )
                self._expires_at = None
            else:
                loader = await load_kube_config(
                    config_file=self.source.paths, client_configuration=configuration, persist_config=False
                )
                self._expires_at = _exec_expiry(loader)
            self._renew_at = renewal_time(self._expires_at, datetime.datetime.now(datetime.UTC))
        except Exception as error:  # the library raises ConfigException, OSError, KeyError, ... for bad input
            reason = " ".join(str(error).split()) or type(error).__name__  # YAML errors span lines: one line here
            raise CredentialsError(f"cannot load {self.source.describe()}: {reason}") from error
        self._loaded_at = time.monotonic()


def _exec_expiry(loader: Any) -> datetime.datetime | None:
    """When an exec plugin's credential expires (None: no plugin, or no expirationTimestamp)."""
    expiry = getattr(loader, "exec_plugin_expiry", None)
    return expiry if isinstance(expiry, datetime.datetime) else None


def renewal_time(expiry: datetime.datetime | None, now: datetime.datetime) -> datetime.datetime | None:
    """When to run the exec plugin again for a credential that expires at `expiry` (None: only after a 401)."""
    if expiry is None:
        return None
    return max(expiry - EXPIRY_LEEWAY, now + (expiry - now) / 2, now + MIN_RENEWAL)


def _bare_token(header_value: Any) -> str | None:
    if not header_value:
        return None
    text = str(header_value)
    return text.split(" ", 1)[1] if text.startswith("Bearer ") else text
