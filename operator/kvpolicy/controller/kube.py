"""A small typed Kubernetes API client: the handful of verbs the operator uses, over aiohttp.

Credentials come from kopf's own login helpers (service account in a pod, else the kubeconfig), so the operator and
kopf talk to the same server the same way. Errors are `ApiError`s; `retryable` ones (409 Conflict, 429, 5xx, network)
are worth another try after a backoff.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import quote

import aiohttp

from kvpolicy.api.v1alpha1 import GROUP, PLURAL, VERSION

Obj = dict[str, Any]
PatchType = Literal["merge", "json"]
CONTENT_TYPES: dict[PatchType, str] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        prefix = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [prefix]
        if namespace is not None:
            parts.append(f"namespaces/{quote(namespace)}")
        parts.append(self.plural)
        if name is not None:
            parts.append(quote(name))
        if subresource is not None:
            parts.append(subresource)
        return "/".join(parts)


DEPLOYMENTS = Resource("apps", "v1", "deployments")
SERVICES = Resource("", "v1", "services")
JOBS = Resource("batch", "v1", "jobs")
PODS = Resource("", "v1", "pods")
NODES = Resource("", "v1", "nodes")
KVPOLICIES = Resource(GROUP, VERSION, PLURAL)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message

    @property
    def retryable(self) -> bool:
        """Conflicts, throttling, server errors and network failures (code 0) may succeed on another try."""
        return self.code in (0, 409, 429) or self.code >= 500


class KubeApi(Protocol):
    """What the operator needs from the API server."""

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        """The object, or None when it does not exist."""
        ...

    async def list_objects(self, resource: Resource, namespace: str | None, label_selector: str = "") -> list[Obj]: ...

    async def create(self, resource: Resource, namespace: str, body: Obj) -> bool:
        """True when created, False when it already existed."""
        ...

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Obj | list[Obj],
        patch_type: PatchType = "merge",
        subresource: str | None = None,
    ) -> Obj | None:
        """The patched object, or None when it does not exist."""
        ...

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        """True when deleted (in the background, dependents included), False when it did not exist."""
        ...

    async def post_event(self, namespace: str, body: Obj) -> None: ...


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate (a subset of kopf's ConnectionInfo)."""

    server: str
    token: str | None = None
    ca_path: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    certificate_path: str | None = None
    private_key_path: str | None = None

    @classmethod
    def from_kopf(cls, info: Any) -> Credentials:
        """From a `kopf.ConnectionInfo`; inline certificate data is written to temporary files for ssl."""

        def material(path: Any, data: Any, suffix: str) -> str | None:
            if path:
                return str(path)
            if not data:
                return None
            raw = data if isinstance(data, bytes) else base64.b64decode(data)
            handle = tempfile.NamedTemporaryFile(prefix="kvpolicy-", suffix=suffix, delete=False)  # noqa: SIM115
            with handle:
                handle.write(raw)
            return handle.name

        ca = info.ca_data
        return cls(
            server=str(info.server).rstrip("/"),
            token=info.token,
            ca_path=str(info.ca_path) if info.ca_path else None,
            ca_data=(ca if isinstance(ca, bytes) else base64.b64decode(ca)) if ca else None,
            insecure=bool(info.insecure),
            certificate_path=material(info.certificate_path, info.certificate_data, ".crt"),
            private_key_path=material(info.private_key_path, info.private_key_data, ".key"),
        )

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        context = ssl.create_default_context(
            cafile=self.ca_path, cadata=self.ca_data.decode() if self.ca_data else None
        )
        if self.certificate_path and self.private_key_path:
            context.load_cert_chain(self.certificate_path, self.private_key_path)
        return context


class HttpKubeApi:
    """`KubeApi` over one aiohttp session; `await close()` when done."""

    def __init__(self, credentials: Credentials, timeout_seconds: float = 30.0) -> None:
        self.credentials = credentials
        headers = {"Accept": "application/json", "User-Agent": "kvpolicy-operator"}
        if credentials.token:
            headers["Authorization"] = f"Bearer {credentials.token}"
        self._session = aiohttp.ClientSession(
            base_url=credentials.server,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_seconds),
            connector=aiohttp.TCPConnector(ssl=credentials.ssl_context(), limit=64),
        )

    async def close(self) -> None:
        await self._session.close()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        missing_ok: bool = False,
    ) -> Obj | None:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            async with self._session.request(method, path, data=data, headers=headers, params=params) as response:
                text = await response.text()
                if response.status == 404 and missing_ok:
                    return None
                if response.status >= 400:
                    raise _api_error(response.status, text)
                return json.loads(text) if text else {}
        except (aiohttp.ClientError, TimeoutError) as error:
            # A timeout's text is empty: name the exception so the log line says what happened.
            what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            raise ApiError(0, "ConnectionError", f"{method} {path}: {what}") from error

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        return await self._request("GET", resource.path(namespace, name), missing_ok=True)

    async def list_objects(self, resource: Resource, namespace: str | None, label_selector: str = "") -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self._request("GET", resource.path(namespace), params=params)
        items: list[Obj] = (result or {}).get("items") or []
        return items

    async def create(self, resource: Resource, namespace: str, body: Obj) -> bool:
        try:
            await self._request("POST", resource.path(namespace), body=body)
        except ApiError as error:
            if error.code == 409 and error.reason == "AlreadyExists":
                return False
            raise
        return True

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Obj | list[Obj],
        patch_type: PatchType = "merge",
        subresource: str | None = None,
    ) -> Obj | None:
        path = resource.path(namespace, name, subresource)
        return await self._request("PATCH", path, body=patch, content_type=CONTENT_TYPES[patch_type], missing_ok=True)

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        result = await self._request("DELETE", resource.path(namespace, name), body=body, missing_ok=True)
        return result is not None

    async def post_event(self, namespace: str, body: Obj) -> None:
        await self._request("POST", f"/api/v1/namespaces/{quote(namespace)}/events", body=body)


def _api_error(code: int, text: str) -> ApiError:
    try:
        status = json.loads(text)
    except ValueError:
        status = {}
    if not isinstance(status, dict):
        status = {}
    return ApiError(code, str(status.get("reason") or "Unknown"), str(status.get("message") or text[:500]))
