"""The operator's small interface to the Kubernetes API (`KubeApi`), and its implementation over kubernetes_asyncio.

`KubernetesApi` calls the library's generated API methods (AppsV1Api, BatchV1Api, CoreV1Api, CustomObjectsApi) and
keeps the JSON as the API server sent it: the operator copies parts of the target Deployment into the canary, and the
library's models would drop fields newer than the models. Credentials come from `login.ClusterLogin` (service account
or kubeconfig, exec plugins included), re-read on a schedule and after a 401. Errors are `ApiError`s; `retryable`
ones (409 Conflict, 429, 5xx, network) are worth another try after a backoff.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import unquote, urlsplit, urlunsplit
from urllib.request import getproxies, proxy_bypass

import aiohttp
from kubernetes_asyncio.client import ApiClient, AppsV1Api, BatchV1Api, CoreV1Api, CustomObjectsApi

from kvpolicy import __version__
from kvpolicy.api.v1alpha1 import GROUP, PLURAL, VERSION
from kvpolicy.kube.login import ClusterLogin, CredentialsError

Obj = dict[str, Any]
PatchType = Literal["merge", "json"]
# Every write names this field manager, so the objects' managedFields attribute all the operator's writes to it.
FIELD_MANAGER = "kvpolicy-operator"
# Requests share a pool of this many connections; watches (one long-lived connection each) have a pool of their own,
# so they can never take every connection from the requests.
REQUEST_CONNECTIONS = 64
WATCH_CONNECTIONS = 32
# kubernetes_asyncio's read buffer (a watch event of a large object is read whole), kept in the session made here.
KUBERNETES_ASYNCIO_READ_BUFSIZE = 2**21
CONTENT_TYPES: dict[PatchType, str] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


@dataclass(frozen=True)
class Resource:
    """A resource type as the API names it. For the built-in groups the generated API's method names come from the
    plural: deployments -> read_namespaced_deployment, list_deployment_for_all_namespaces, ..."""

    group: str  # "" for the core group
    version: str
    plural: str
    snake_kind: str = ""  # the generated methods' name for a kind whose plural is not snake_case + "s"

    @property
    def method_kind(self) -> str:
        return self.snake_kind or self.plural.removesuffix("s")


DEPLOYMENTS = Resource("apps", "v1", "deployments")
SERVICES = Resource("", "v1", "services")
JOBS = Resource("batch", "v1", "jobs")
PODS = Resource("", "v1", "pods")
NODES = Resource("", "v1", "nodes")
EVENTS = Resource("", "v1", "events")
SECRETS = Resource("", "v1", "secrets")
CONFIG_MAPS = Resource("", "v1", "configmaps", snake_kind="config_map")
KVPOLICIES = Resource(GROUP, VERSION, PLURAL)
# traffic InferencePool: the Gateway API's route and the Inference Extension's pools (CustomObjectsApi).
HTTP_ROUTES = Resource("gateway.networking.k8s.io", "v1", "httproutes")
INFERENCE_POOLS = Resource("inference.networking.k8s.io", "v1", "inferencepools")


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


@dataclass(frozen=True)
class FieldEquals:
    """A list's objects whose field at `path` (spec.targetRef.name: `("spec", "targetRef", "name")`) is `value`.
    Selected by the client: the API server selects custom resources by metadata.name and metadata.namespace only;
    a cache (cached.py) answers from an index of that field, without looking at every object."""

    path: tuple[str, ...]
    value: str

    def holds(self, obj: Mapping[str, Any]) -> bool:
        return field_value(obj, self.path) == self.value


def field_value(obj: Mapping[str, Any], path: tuple[str, ...]) -> object:
    """The value at `path`, None where a part of it is missing or not an object."""
    found: object = obj
    for part in path:
        if not isinstance(found, Mapping):
            return None
        found = found.get(part)
    return found


class KubeApi(Protocol):
    """What the operator needs from the API server."""

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        """The object, or None when it does not exist."""
        ...

    async def list_objects(
        self,
        resource: Resource,
        namespace: str | None,
        label_selector: str = "",
        since: Obj | None = None,
        where: FieldEquals | None = None,
    ) -> list[Obj]:
        """The objects (those `where` holds for, if given). `since`, an object of this list: the list holds every
        write the API server made before that object's current generation (a cache answers once it holds the object
        at that generation; a list from the API server always does)."""
        ...

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


def environment_proxy(url: str) -> tuple[str, dict[str, str]] | None:
    """The proxy the environment (HTTP_PROXY, HTTPS_PROXY, NO_PROXY) gives `url`, as aiohttp picks it for a session
    that trusts the environment (HTTP proxies only), and its credentials as a Proxy-Authorization header."""
    target = urlsplit(url)
    if not target.hostname or proxy_bypass(target.hostname):
        return None
    proxy = getproxies().get(target.scheme)
    if not proxy:
        return None
    parts = urlsplit(proxy)
    if parts.scheme in ("https", "wss") or not parts.hostname:  # aiohttp ignores these from the environment
        return None
    if parts.username is None:
        return proxy, {}
    credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
    bare = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))
    return urlunsplit(bare), {"Proxy-Authorization": f"Basic {base64.b64encode(credentials).decode()}"}


def look_up_the_environment_once(client: ApiClient) -> None:
    """kubernetes_asyncio's HTTP session trusts the environment, so aiohttp looks for a ~/.netrc entry and for the
    proxy variables in a thread of its executor, twice per request: thousands of policies' passes queued behind
    those threads (issue 28). The session is replaced by one that does not, with the proxy the environment gives the
    API server looked up here, once. (A netrc entry for the API server would only make aiohttp refuse every request:
    they carry an Authorization header already.)"""
    rest = client.rest_client
    host = str(client.configuration.host)
    found = None if rest.proxy else environment_proxy(host)
    if found is not None:
        rest.proxy, headers = found
        if host.startswith("https:"):  # the proxy's credentials go with the CONNECT of the tunnel, as aiohttp's
            rest.proxy_headers = {**(rest.proxy_headers or {}), **headers}
        else:  # plain HTTP: with each request the proxy forwards, as aiohttp sends them
            for key, value in headers.items():
                client.set_default_header(key, value)
    trusting = rest.pool_manager
    rest.pool_manager = aiohttp.ClientSession(
        connector=trusting.connector, trust_env=False, read_bufsize=KUBERNETES_ASYNCIO_READ_BUFSIZE
    )
    trusting.detach()  # the connector (its pool and TLS context) now belongs to the new session


# The groups whose resources have generated API classes; every other group is served by CustomObjectsApi.
_BUILTIN_APIS = {"": CoreV1Api, "apps": AppsV1Api, "batch": BatchV1Api}


class KubernetesApi:
    """`KubeApi` over kubernetes_asyncio; create with `await KubernetesApi.connect(login)`, `await close()` when
    done. Besides the KubeApi verbs it lists whole collections and watches them, for `cached.CachedKubeApi`."""

    def __init__(
        self, client: ApiClient, watch_client: ApiClient, login: ClusterLogin, timeout_seconds: float = 30.0
    ) -> None:
        self.login = login
        self.timeout_seconds = timeout_seconds
        self._clients = (client, watch_client)
        self._builtin = {group: api(client) for group, api in _BUILTIN_APIS.items()}
        self._custom = CustomObjectsApi(client)
        self._watch_builtin = {group: api(watch_client) for group, api in _BUILTIN_APIS.items()}
        self._watch_custom = CustomObjectsApi(watch_client)

    @classmethod
    async def connect(cls, login: ClusterLogin, timeout_seconds: float = 30.0) -> KubernetesApi:
        configuration = await login.configuration()
        clients = []
        for connections in (REQUEST_CONNECTIONS, WATCH_CONNECTIONS):
            configuration.connection_pool_maxsize = connections  # read when the client's pool is made
            client = ApiClient(configuration)
            client.user_agent = f"{FIELD_MANAGER}/{__version__}"
            look_up_the_environment_once(client)
            clients.append(client)
        return cls(clients[0], clients[1], login, timeout_seconds)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()

    # --- KubeApi ----------------------------------------------------------------------------------------------

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        return await self._call(resource, "read", namespace, missing_ok=True, name=name)

    async def list_objects(
        self,
        resource: Resource,
        namespace: str | None,
        label_selector: str = "",
        since: Obj | None = None,
        where: FieldEquals | None = None,
    ) -> list[Obj]:
        items: list[Obj] = (await self.list_collection(resource, namespace, label_selector)).get("items") or []
        return items if where is None else [item for item in items if where.holds(item)]

    async def create(self, resource: Resource, namespace: str, body: Obj) -> bool:
        try:
            await self._call(resource, "create", namespace, body=body, field_manager=FIELD_MANAGER)
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
        return await self._call(
            resource,
            "patch",
            namespace,
            subresource,
            missing_ok=True,
            name=name,
            body=patch,
            field_manager=FIELD_MANAGER,
            _content_type=CONTENT_TYPES[patch_type],
        )

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        deleted = await self._call(
            resource, "delete", namespace, missing_ok=True, name=name, propagation_policy="Background"
        )
        return deleted is not None

    async def post_event(self, namespace: str, body: Obj) -> None:
        await self._call(EVENTS, "create", namespace, body=body, field_manager=FIELD_MANAGER)

    # --- lists and watches ------------------------------------------------------------------------------------

    async def list_collection(self, resource: Resource, namespace: str | None, label_selector: str = "") -> Obj:
        """The whole list as the API server sends it: `items`, and `metadata.resourceVersion` to watch from."""
        return await self._call(resource, "list", namespace, label_selector=label_selector or None) or {}

    async def watch(
        self,
        resource: Resource,
        namespace: str | None,
        label_selector: str,
        resource_version: str,
        timeout_seconds: int,
    ) -> AsyncIterator[tuple[str, Obj]]:
        """(event type, object) from `resource_version` on, BOOKMARKs included, until the server ends the stream
        after `timeout_seconds`. Failures (410 Gone for a version too old, 401, network) raise `ApiError`; after a
        401 the credentials are loaded again first, so the caller's next list and watch use fresh ones.

        The generated list method streams the events; their lines are read here rather than through the library's
        `Watch`, which builds an ApiClient (an aiohttp session and a TLS context) of its own for every stream."""
        method, names = self._method(resource, "list", namespace, None, watching=True)
        try:
            response = await method(
                **names,
                label_selector=label_selector or None,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                watch=True,
                _preload_content=False,
                _request_timeout=(self.timeout_seconds, timeout_seconds + self.timeout_seconds),
            )
            async with response:
                if response.status >= 400:
                    if response.status == 401:
                        sent = response.request_info.headers.get("Authorization", "")
                        await self._reload_credentials(sent.removeprefix("Bearer ") or None)
                    raise _api_error(response.status, await response.text())
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":  # e.g. 410 Gone: the version fell out of the server's window
                        raise _api_error(int(event["object"].get("code") or 0), json.dumps(event["object"]))
                    yield str(event["type"]), event["object"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
            raise ApiError(0, "WatchFailed", f"watch {resource.plural}: {_describe(error)}") from error

    # --- calling the generated API ----------------------------------------------------------------------------

    def _method(
        self, resource: Resource, verb: str, namespace: str | None, subresource: str | None, watching: bool = False
    ) -> Any:
        """The generated method for a verb on a resource, e.g. AppsV1Api.patch_namespaced_deployment_status, with
        the arguments that name the resource; the caller adds the rest as keywords."""
        suffix = f"_{subresource}" if subresource else ""
        builtin, custom = (self._watch_builtin, self._watch_custom) if watching else (self._builtin, self._custom)
        if resource.group in builtin:
            api = builtin[resource.group]
            kind = resource.method_kind
            if namespace is not None:
                return getattr(api, f"{verb}_namespaced_{kind}{suffix}"), {"namespace": namespace}
            all_namespaces = f"{verb}_{kind}_for_all_namespaces"
            return getattr(api, all_namespaces if hasattr(api, all_namespaces) else f"{verb}_{kind}{suffix}"), {}
        names = {"group": resource.group, "version": resource.version}
        if namespace is None:  # only listed across namespaces
            return custom.list_custom_object_for_all_namespaces, {**names, "resource_plural": resource.plural}
        verb = "get" if verb == "read" else verb
        method = getattr(custom, f"{verb}_namespaced_custom_object{suffix}")
        return method, {**names, "plural": resource.plural, "namespace": namespace}

    async def _call(
        self,
        resource: Resource,
        verb: str,
        namespace: str | None,
        subresource: str | None = None,
        *,
        missing_ok: bool = False,
        **arguments: Any,
    ) -> Obj | None:
        """Call the API; the response's JSON, or None for a 404 when `missing_ok`. A 401 loads the credentials
        again (a rotated token file, an expired exec credential) and the call is made once more."""
        method, names = self._method(resource, verb, namespace, subresource)
        for attempt in range(2):
            try:
                response = await method(
                    **names, **arguments, _preload_content=False, _request_timeout=self.timeout_seconds
                )
                async with response:
                    status, text = response.status, await response.text()
                    sent = response.request_info.headers.get("Authorization", "")
            except (aiohttp.ClientError, TimeoutError) as error:
                what = f"{verb} {resource.plural}"
                raise ApiError(0, "ConnectionError", f"{what}: {_describe(error)}") from error
            if status == 401 and attempt == 0:
                await self._reload_credentials(sent.removeprefix("Bearer ") or None)
                continue
            if status == 404 and missing_ok:
                return None
            if status >= 400:
                raise _api_error(status, text)
            result: Obj = json.loads(text) if text else {}
            return result
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _reload_credentials(self, rejected_token: str | None) -> None:
        try:
            await self.login.refresh(rejected_token)
        except CredentialsError as error:  # e.g. an exec plugin whose identity provider is down: worth retrying
            raise ApiError(0, "CredentialsUnavailable", str(error)) from error


def _describe(error: BaseException) -> str:
    """An exception for a log line: a timeout's text is empty, so name its type too."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _api_error(code: int, text: str) -> ApiError:
    try:
        status = json.loads(text)
    except ValueError:
        status = {}
    if not isinstance(status, dict):
        status = {}
    return ApiError(code, str(status.get("reason") or "Unknown"), str(status.get("message") or text[:500]))
