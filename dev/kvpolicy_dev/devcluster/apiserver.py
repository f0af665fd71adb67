"""The emulated Kubernetes API server: kmock's Kubernetes scaffold with a real state layer behind it.

kmock's own `KubernetesEmulator` changes state before user reactions run (so an injected fault still mutates), and
its list/watch ignore resourceVersion and selectors. This subclass keeps kmock's HTTP server, request recording and
DSL reactions, and serves everything else from `Store`: resource versions, selectors, watches resumed from the event
log, the status subresource, discovery for CRDs applied at runtime and server-side `Table` printing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock

from kvpolicy_dev.devcluster import protobuf
from kvpolicy_dev.devcluster.resources import ResourceType
from kvpolicy_dev.devcluster.selectors import Selector, SelectorError, parse_field_selector, parse_label_selector
from kvpolicy_dev.devcluster.store import ApiError, Store, WatchEvent
from kvpolicy_dev.devcluster.tables import render_table

# kmock records every request for assertions; a session-long server keeps only the latest ones.
REQUEST_HISTORY_LIMIT = 10_000
SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-kvpolicy-devcluster",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
# kube-apiserver's health endpoints (readable by every user); they answer "ok" unless a fault says otherwise.
HEALTH_PATHS = frozenset({"/healthz", "/livez", "/readyz"})
# An empty protobuf message is an empty OpenAPI v2 document: kubectl then validates nothing client-side.
OPENAPI_V2_PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Gone",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def query_flag(value: str | None) -> bool:
    """A boolean query parameter as kube-apiserver reads it (Go's strconv.ParseBool): clients send `true`, `1` or,
    from Python, `True`."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


@dataclass(frozen=True)
class ApiPath:
    """A parsed resource URL: /api/v1/namespaces/NS/PLURAL/NAME/SUBRESOURCE and the /apis/GROUP/VERSION forms."""

    group: str
    version: str
    plural: str | None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None

    @classmethod
    def parse(cls, path: str) -> ApiPath | None:
        parts = [part for part in path.split("/") if part]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace = None
        # /namespaces/NS/PLURAL... is a namespaced resource; /namespaces/NS[/status] is the namespace object itself.
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            namespace, rest = rest[1], rest[2:]
        if not rest:
            return cls(group, version, None)
        if len(rest) > 3:
            return None
        return cls(group, version, rest[0], namespace, *rest[1:])

    def action(self, method: str, watch: str | None) -> kmock.action | None:
        """The Kubernetes verb, for kmock's request filters (`api["patch", ...]`)."""
        if method == "GET" and query_flag(watch):
            return kmock.action.WATCH
        if method == "GET":
            return kmock.action.FETCH if self.name else kmock.action.LIST
        return {
            "POST": kmock.action.CREATE,
            "PATCH": kmock.action.UPDATE,
            "PUT": kmock.action.UPDATE,
            "DELETE": kmock.action.DELETE,
        }.get(method)


WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# The write log is kept for the whole session; a test reads the part after its own start.
WRITE_LOG_LIMIT = 100_000


def requester(headers: Mapping[str, str]) -> str | None:
    """Who sent a request: its bearer token (the emulator authenticates no one, it only tells clients apart)."""
    authorization = headers.get("Authorization", "")
    return authorization.removeprefix("Bearer ") if authorization.startswith("Bearer ") else None


@dataclass(frozen=True)
class WriteRecord:
    """One answered write, as an API server's audit log keeps it: when, who, what, and the HTTP status."""

    time: float  # Unix time the answer was sent
    user: str | None
    method: str
    path: ApiPath | None
    code: int

    @property
    def resource(self) -> str | None:
        return self.path.plural if self.path else None


@dataclass
class Fault:
    """Fail the next `times` requests that match every given field with `code` (a Kubernetes `Status`)."""

    code: int
    times: int
    method: str | None = None
    resource: str | None = None  # plural, e.g. "deployments"
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    message: str = "injected by the test"
    user: str | None = None  # the requests of one client only (its bearer token)
    ends_watches: bool = False  # an outage: matching watch streams end too, instead of staying connected
    hits: int = 0

    def matches(self, method: str, path: ApiPath | None, user: str | None = None) -> bool:
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.user is not None and self.user != user:
            return False
        wanted = (self.resource, self.namespace, self.name, self.subresource)
        if path is None:
            return all(field is None for field in wanted)
        actual = (path.plural, path.namespace, path.name, path.subresource)
        return all(want is None or want == got for want, got in zip(wanted, actual, strict=True))

    def error(self) -> ApiError:
        return ApiError(self.code, _REASONS.get(self.code, "InternalError"), self.message)


def _json(payload: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(payload, status=status)


@attrs.define(kw_only=True)
class EmulatedApiServer(kmock.KubernetesScaffold):
    store: Store = attrs.field(factory=Store)
    # Reads a pod's container log for GET .../pods/NAME/log; the kubelet provides it.
    pod_log_reader: Callable[[str, str], str] | None = None
    # Bearer tokens the server accepts; None accepts every request (the default: the cluster is a test fixture).
    accepted_tokens: frozenset[str] | None = None
    # How often a watch with allowWatchBookmarks=true gets a BOOKMARK when nothing else was sent (kube-apiserver:
    # about once a minute; shorter here so tests see them).
    bookmark_seconds: float = 1.0
    _faults: list[Fault] = attrs.field(factory=list, init=False)
    _faults_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _writes: collections.deque[WriteRecord] = attrs.field(
        factory=lambda: collections.deque(maxlen=WRITE_LOG_LIMIT), init=False
    )

    def __attrs_post_init__(self) -> None:
        # The scaffold's fallback reactions are not registered: `_route` serves everything they would, and each
        # registered reaction is matched against the whole request history on every request.
        pass

    # --- test controls --------------------------------------------------------------------------------------------

    def fail_next(
        self,
        times: int,
        code: int,
        *,
        method: str | None = None,
        resource: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str | None = None,
        user: str | None = None,
    ) -> Fault:
        """Inject a fault: e.g. `fail_next(2, 409, method="PATCH", resource="deployments", subresource="status")`."""
        fault = Fault(code, times, method, resource, namespace, name, subresource, user=user)
        with self._faults_lock:
            self._faults.append(fault)
        return fault

    def outage(
        self, code: int = 503, *, method: str | None = None, resource: str | None = None, user: str | None = None
    ) -> Fault:
        """Fail every matching request (of `user`'s client only, if given) with `code` until `end_fault`, and end the
        matching watch streams open now, as when the API server, or the network to it, goes down."""
        message = "the API server is unavailable (an outage injected by the test)"
        fault = Fault(code, sys.maxsize, method, resource, message=message, user=user, ends_watches=True)
        with self._faults_lock:
            self._faults.append(fault)
        self.store.notify()  # wake the watch streams, which then see the outage and end
        return fault

    def end_fault(self, fault: Fault) -> None:
        with self._faults_lock:
            self._faults.remove(fault)

    def clear_faults(self) -> None:
        with self._faults_lock:
            self._faults.clear()

    def accept_tokens(self, tokens: frozenset[str] | None) -> None:
        """From now on answer 401 Unauthorized, as kube-apiserver does, to requests without one of these bearer
        tokens (None: accept everything). Revoking a token that a client holds is how tests expire it."""
        self.accepted_tokens = tokens

    @property
    def writes(self) -> tuple[WriteRecord, ...]:
        """Every create, update, patch and delete the server answered (the latest `WRITE_LOG_LIMIT`), in order."""
        return tuple(self._writes)

    def close_watches(self) -> None:
        """End every watch stream, so the HTTP server can shut down without waiting for them."""
        self._closing = True
        self.store.notify()

    def _take_fault(self, method: str, path: ApiPath | None, user: str | None) -> ApiError | None:
        with self._faults_lock:
            for fault in self._faults:
                if fault.hits < fault.times and fault.matches(method, path, user):
                    fault.hits += 1
                    return fault.error()
        return None

    def _cut_off(self, path: ApiPath, user: str | None) -> bool:
        """Whether an outage now covers a watch stream of `user` on `path`."""
        with self._faults_lock:
            return any(fault.ends_watches and fault.matches("GET", path, user) for fault in self._faults)

    # --- request handling -----------------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's own request parsing fails on some valid URLs (e.g. /api/v1/namespaces), so requests are parsed here.
        body = await raw_request.read()
        path = ApiPath.parse(raw_request.path)
        data: Any
        try:
            if "protobuf" in raw_request.headers.get("Content-Type", ""):
                data = protobuf.decode(body)
            else:
                data = json.loads(body) if body else None
        except protobuf.ProtobufError as exc:
            return _json(ApiError(415, "UnsupportedMediaType", str(exc)).status(), 415)
        except ValueError:
            return _json(ApiError(400, "BadRequest", "the request body is not valid JSON").status(), 400)
        request = kmock.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode(errors="replace"),
            data=data,
            action=path.action(raw_request.method, raw_request.query.get("watch")) if path else None,
            resource=kmock.resource(path.group, path.version, path.plural) if path and path.plural else None,
            namespace=path.namespace if path else None,
            name=path.name if path else None,
            subresource=path.subresource if path else None,
        )
        self._requests.append(request)
        if len(self._requests) > REQUEST_HISTORY_LIMIT:
            del self._requests[: len(self._requests) - REQUEST_HISTORY_LIMIT]
        try:
            response = await self._serve(request, path)
        except ApiError as exc:
            response = _json(exc.status(), exc.code)
        if raw_request.method in WRITE_METHODS:
            self._writes.append(
                WriteRecord(time.time(), requester(request.headers), raw_request.method, path, response.status)
            )
        return response

    async def _serve(self, request: kmock.Request, path: ApiPath | None) -> aiohttp.web.StreamResponse:
        method = request.method.value
        if self.accepted_tokens is not None:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme != "Bearer" or token not in self.accepted_tokens:
                raise ApiError(401, "Unauthorized", "Unauthorized")
        fault = self._take_fault(method, path, requester(request.headers))
        if fault is not None:
            raise fault
        if self._payloads:  # reactions a test declared with kmock's DSL take precedence
            with contextlib.suppress(NotImplementedError):
                response: aiohttp.web.StreamResponse = await super()._handle(request)
                return response
        return await self._route(request, method, path)

    async def _route(self, request: kmock.Request, method: str, path: ApiPath | None) -> aiohttp.web.StreamResponse:
        url_path = request.url.path.rstrip("/") or "/"
        if method == "GET" and url_path == "/openapi/v2":
            return aiohttp.web.Response(body=b"", content_type=OPENAPI_V2_PROTOBUF)
        if method == "GET" and url_path in HEALTH_PATHS:
            return aiohttp.web.Response(text="ok")
        if method == "GET" and path is None:
            return _json(self._discovery(url_path))
        if path is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource: {url_path}")
        if path.plural is None:
            if method != "GET":
                raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on {url_path}")
            return _json(self._resource_list(path))
        rt = self.store.find_type(path.group, path.version, path.plural)
        if rt.namespaced and path.name is not None and path.namespace is None:
            raise ApiError(404, "NotFound", f"{rt.plural} is namespaced: use /namespaces/NAMESPACE/{rt.plural}/NAME")
        params = request.params
        if path.subresource == "log" and rt.key == ("", "pods") and method == "GET":
            return self._pod_log(path)
        if method == "GET" and path.name is None and query_flag(params.get("watch")):
            return await self._watch(request, rt, path)
        if method == "GET" and path.name is None:
            items = self.store.list_objects(rt, path.namespace, *self._selectors(params))
            return self._listing(request, rt, items)
        if method == "GET" and path.subresource == "scale":
            return _json(self.store.scale(rt, path.namespace, path.name or ""))
        if method == "GET":
            obj = self.store.get(rt, path.namespace, path.name or "")
            return self._listing(request, rt, [obj]) if self._wants_table(request) else _json(obj)
        body = request.data
        if method == "POST" and path.name is None:
            if not isinstance(body, Mapping):
                raise ApiError(400, "BadRequest", "the request body must be a JSON object")
            return _json(self.store.create(rt, path.namespace, body), 201)
        if method == "PUT" and path.name is not None:
            if not isinstance(body, Mapping):
                raise ApiError(400, "BadRequest", "the request body must be a JSON object")
            return _json(self.store.replace(rt, path.namespace, path.name, body, path.subresource))
        if method == "PATCH" and path.name is not None:
            content_type = request.headers.get("Content-Type", "application/merge-patch+json")
            return _json(self.store.patch(rt, path.namespace, path.name, content_type, body, path.subresource))
        if method == "DELETE" and path.name is not None:
            options = body if isinstance(body, Mapping) else {}
            propagation = params.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
            return _json(self.store.delete(rt, path.namespace, path.name, propagation))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on {url_path}")

    @staticmethod
    def _selectors(params: Mapping[str, str]) -> tuple[Selector | None, Selector | None]:
        try:
            labels = parse_label_selector(params["labelSelector"]) if params.get("labelSelector") else None
            fields = parse_field_selector(params["fieldSelector"]) if params.get("fieldSelector") else None
        except SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from exc
        return labels, fields

    @staticmethod
    def _wants_table(request: kmock.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    def _listing(self, request: kmock.Request, rt: ResourceType, items: list[dict[str, Any]]) -> aiohttp.web.Response:
        resource_version = str(self.store.resource_version)
        if self._wants_table(request):
            now = datetime.datetime.now(datetime.UTC)
            return _json(render_table(items, rt.printer_columns, resource_version, now))
        return _json(
            {
                "apiVersion": rt.api_version,
                "kind": f"{rt.kind}List",
                "metadata": {"resourceVersion": resource_version},
                "items": items,
            }
        )

    def _pod_log(self, path: ApiPath) -> aiohttp.web.Response:
        namespace, name = path.namespace or "", path.name or ""
        self.store.get(self.store.find_type("", "v1", "pods"), namespace, name)
        text = self.pod_log_reader(namespace, name) if self.pod_log_reader is not None else ""
        return aiohttp.web.Response(text=text, content_type="text/plain")

    # --- watching -------------------------------------------------------------------------------------------------

    async def _watch(self, request: kmock.Request, rt: ResourceType, path: ApiPath) -> aiohttp.web.StreamResponse:
        params = request.params
        label_selector, field_selector = self._selectors(params)

        def visible(obj: Mapping[str, Any] | None) -> bool:
            return (
                obj is not None
                and (path.namespace is None or not rt.namespaced or obj["metadata"].get("namespace") == path.namespace)
                and (label_selector is None or label_selector(obj))
                and (field_selector is None or field_selector(obj))
            )

        def event_type(event: WatchEvent) -> str | None:
            if event.key != rt.key:
                return None
            now_visible, was_visible = visible(event.obj), visible(event.old)
            if event.type != "MODIFIED":
                return event.type if now_visible else None
            # An object entering or leaving the selection is added or deleted from the watcher's point of view.
            if now_visible:
                return "MODIFIED" if was_visible else "ADDED"
            return "DELETED" if was_visible else None

        def as_table(obj: dict[str, Any]) -> dict[str, Any]:
            """`kubectl get -w` watches Tables: each event carries a one-row Table."""
            if not self._wants_table(request):
                return obj
            now = datetime.datetime.now(datetime.UTC)
            return render_table([obj], rt.printer_columns, obj["metadata"]["resourceVersion"], now)

        requested_version = params.get("resourceVersion", "")
        if not requested_version.isdigit() and requested_version != "":
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {requested_version!r}")
        bookmarks = query_flag(params.get("allowWatchBookmarks"))
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert request._raw_request is not None  # kmock keeps it for every request that came over HTTP
        await response.prepare(request._raw_request)
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        try:
            async with asyncio.timeout(timeout):
                if requested_version in ("", "0"):
                    position = self.store.resource_version
                    for obj in self.store.list_objects(rt, path.namespace, label_selector, field_selector):
                        await self._send(response, "ADDED", as_table(obj))
                else:
                    position = int(requested_version)
                last_sent = time.monotonic()
                user = requester(request.headers)
                while not self._closing and not self._cut_off(path, user):
                    for event in self.store.events_since(position):
                        position = event.resource_version
                        kind = event_type(event)
                        if kind is not None:
                            await self._send(response, kind, as_table(event.obj))
                            last_sent = time.monotonic()
                    if bookmarks and time.monotonic() - last_sent >= self.bookmark_seconds:
                        # Where the stream has got to, events of other objects included: a watch resumed from here
                        # replays nothing it has seen, and does not fall out of the event log while nothing matches.
                        await self._send(response, "BOOKMARK", self._bookmark(rt, position))
                        last_sent = time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self.store.wait_for_change(position), self.bookmark_seconds if bookmarks else None
                        )
        except TimeoutError:
            pass  # the client's timeoutSeconds: end the stream normally
        except ApiError as exc:
            await self._send(response, "ERROR", exc.status())
        except ConnectionError:
            return response  # the client went away
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    @staticmethod
    def _bookmark(rt: ResourceType, position: int) -> dict[str, Any]:
        return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": {"resourceVersion": str(position)}}

    @staticmethod
    async def _send(response: aiohttp.web.StreamResponse, event_type: str, obj: Mapping[str, Any]) -> None:
        await response.write(json.dumps({"type": event_type, "object": obj}).encode() + b"\n")

    # --- discovery ------------------------------------------------------------------------------------------------

    def _groups(self) -> dict[str, list[ResourceType]]:
        groups: dict[str, list[ResourceType]] = {}
        for rt in self.store.types():
            groups.setdefault(rt.group, []).append(rt)
        return groups

    def _group_entry(self, group: str, types: list[ResourceType]) -> dict[str, Any]:
        versions = sorted(
            {rt.version for rt in types},
            key=lambda version: not any(rt.preferred and rt.version == version for rt in types),
        )
        entries = [{"groupVersion": f"{group}/{version}", "version": version} for version in versions]
        return {"name": group, "versions": entries, "preferredVersion": entries[0]}

    def _discovery(self, url_path: str) -> dict[str, Any]:
        groups = self._groups()
        if url_path == "/version":
            return SERVER_VERSION
        if url_path == "/openapi/v3":
            return {"paths": {}}
        if url_path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if url_path == "/apis":
            named = [self._group_entry(group, types) for group, types in sorted(groups.items()) if group]
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": named}
        if url_path.startswith("/apis/") and url_path.count("/") == 2:
            group = url_path.split("/")[2]
            if group not in groups or not group:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource: {url_path}")
            return {"kind": "APIGroup", "apiVersion": "v1", **self._group_entry(group, groups[group])}
        if url_path == "/":
            paths = ["/api", "/api/v1", "/apis", "/version"]
            paths += [f"/apis/{group}/{rt.version}" for group, types in groups.items() if group for rt in types]
            return {"paths": sorted(set(paths))}
        raise ApiError(404, "NotFound", f"the server could not find the requested resource: {url_path}")

    def _resource_list(self, path: ApiPath) -> dict[str, Any]:
        types = [rt for rt in self.store.types() if (rt.group, rt.version) == (path.group, path.version)]
        if not types:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource: {path.group}")
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": types[0].api_version,
            "resources": [entry for rt in types for entry in rt.discovery_entries()],
        }
