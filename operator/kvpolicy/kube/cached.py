"""`KubeApi` with some lists answered from watches instead of a request on every pass.

Each `Informer` lists one selection once, then follows it with a watch resumed from the list's resourceVersion, with
bookmarks (so a quiet selection never falls out of the API server's event window); a 410 Gone or any failure makes it
list again. A list is answered from an informer only while it is synced; otherwise, and for every other read, the
request goes to the API server as before. Reads from a cache may lag the operator's own writes by a watch event: the
step tolerates that (a Create of an object not seen yet is AlreadyExists, a Delete of one still seen is NotFound).
A list that must hold every write made before some object's current generation (`since`: the first pass of a rollout
reads who governs its target so) waits for the informer to hold that object so: a watch delivers events in the
order of the writes, so everything written before is in the cache too. Asking the API server instead cost each such
pass a list of every policy of the namespace: N policies starting at once, N lists of N (issue 28).

What is cached (`CachedKubeApi.selections`): the operator's own children (Services, Jobs, Pods labelled with their
policy), watched per namespace once a policy there lists them; and the nodes' metadata (their labels are all the
planner reads), watched cluster-wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvpolicy.kube.api import (
    JOBS,
    KVPOLICIES,
    NODES,
    PODS,
    SERVICES,
    ApiError,
    FieldEquals,
    KubernetesApi,
    Obj,
    PatchType,
    Resource,
    field_value,
)
from kvpolicy.rollout.ownership import TARGET_NAME_PATH

logger = logging.getLogger(__name__)
# The API server ends each watch after this long, and it is resumed from the last resourceVersion seen.
WATCH_SECONDS = 300
# After a failure the informer lists again after this long, doubling up to the maximum while it keeps failing.
RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 30.0
# How long a list `since` an object waits for its informer to hold that object before asking the API server: the
# informer's watch and kopf's (which started the pass) are streams of the same writes, normally a moment apart.
SINCE_WAIT_SECONDS = 10.0


def equality_terms(selector: str) -> dict[str, str] | None:
    """`a=b,c=d` as a dict; None for anything else (set-based terms, `!=`), which is never answered from a cache."""
    terms: dict[str, str] = {}
    for term in filter(None, selector.split(",")):
        key, sep, value = term.partition("=")
        if not sep or key.endswith("!") or value.startswith("=") or not key:
            return None
        terms[key] = value
    return terms


def metadata_only(obj: Obj) -> Obj:
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": obj.get("metadata") or {}}


Key = tuple[str, str]  # (namespace, name)


@dataclass
class Informer:
    """A watch-backed copy of the objects of `resource` in `namespace` (None: all) that carry `label_key` (None:
    every object), each kept as `keep` returns it, and indexed by the field at `indexed` (a path) if given."""

    api: KubernetesApi
    resource: Resource
    namespace: str | None
    label_key: str | None
    keep: Callable[[Obj], Obj] = lambda obj: obj
    indexed: tuple[str, ...] | None = None
    synced: bool = field(default=False, init=False)
    _objects: dict[Key, Obj] = field(default_factory=dict, init=False)
    _sorted: list[Obj] | None = field(default=None, init=False)  # _objects in name order, until the next change
    # The `indexed` field's value -> the keys of the objects holding it (N policies each asking who else names its
    # target: one lookup each rather than a look at all N).
    _index: dict[object, set[Key]] = field(default_factory=dict, init=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"informer {self.resource.plural} {self.namespace}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def select(self, labels: Mapping[str, str], where: FieldEquals | None = None) -> list[Obj]:
        """The cached objects whose labels include `labels` (and that `where` holds for), in name order (as the API
        server lists them)."""
        if where is not None and where.path == self.indexed:
            found = [self._objects[key] for key in sorted(self._index.get(where.value, ()))]
        else:
            if self._sorted is None:  # sorted once per change, not per pass
                self._sorted = [obj for _, obj in sorted(self._objects.items())]
            found = self._sorted if where is None else [obj for obj in self._sorted if where.holds(obj)]
        if not labels:
            return list(found)
        return [
            obj
            for obj in found
            if all((obj["metadata"].get("labels") or {}).get(key) == value for key, value in labels.items())
        ]

    def holds(self, obj: Obj) -> bool:
        """Whether the synced cache holds `obj` (same uid) at its generation or a later one."""
        meta = obj["metadata"]
        kept = self._objects.get(self._key(obj)) if self.synced else None
        if kept is None or kept["metadata"].get("uid") != meta.get("uid"):
            return False
        return int(kept["metadata"].get("generation") or 0) >= int(meta.get("generation") or 0)

    async def wait_until_holds(self, obj: Obj) -> None:
        """Return once `holds(obj)` (callers bound the wait)."""
        while not self.holds(obj):
            await self._changed.wait()

    def _touched(self) -> None:
        self._sorted = None
        self._changed.set()  # wakes every waiter; the next change has an event of its own
        self._changed = asyncio.Event()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                version = await self._list()
                failures = 0
                while True:  # the server ends each watch after WATCH_SECONDS: resume where it stopped
                    version = await self._follow(version)
            except Exception as error:  # the cache must outlive any failure: lists fall back meanwhile
                self.synced = False
                if isinstance(error, ApiError) and error.code == 410:  # fell out of the server's window: list again
                    continue
                failures += 1
                delay = min(MAX_RETRY_SECONDS, RETRY_SECONDS * 2 ** (failures - 1))
                logger.warning("watch of %s failed (%s); listing again in %.0f s", self.resource.plural, error, delay)
                await asyncio.sleep(delay)

    async def _list(self) -> str:
        collection = await self.api.list_collection(self.resource, self.namespace, self.label_key or "")
        self._objects, self._index = {}, {}
        for obj in collection.get("items") or []:
            self._put(self._key(obj), self.keep(obj))
        self.synced = True
        self._touched()
        return str(collection["metadata"]["resourceVersion"])

    async def _follow(self, version: str) -> str:
        events = self.api.watch(self.resource, self.namespace, self.label_key or "", version, WATCH_SECONDS)
        async for event_type, obj in events:
            version = str(obj["metadata"]["resourceVersion"])
            key = self._key(obj)
            if event_type == "DELETED":
                self._drop(key)
            elif event_type in ("ADDED", "MODIFIED"):
                kept = self.keep(obj)
                if self._objects.get(key) == kept:  # a change to what is not kept (a policy's status): nothing to do
                    continue
                self._put(key, kept)
            else:  # BOOKMARK: only the version moves on
                continue
            self._touched()
        return version

    def _put(self, key: Key, obj: Obj) -> None:
        self._drop(key)
        self._objects[key] = obj
        if self.indexed is not None:
            self._index.setdefault(field_value(obj, self.indexed), set()).add(key)

    def _drop(self, key: Key) -> None:
        gone = self._objects.pop(key, None)
        if gone is not None and self.indexed is not None:
            value = field_value(gone, self.indexed)
            keys = self._index.get(value)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[value]

    @staticmethod
    def _key(obj: Obj) -> Key:
        return str(obj["metadata"].get("namespace") or ""), str(obj["metadata"]["name"])


@dataclass(frozen=True)
class Selection:
    """Which lists of a resource an informer answers: those whose selector names `label_key` (None: any list of the
    resource), in `namespaced` informers (one per namespace) or one cluster-wide informer; `indexed`: the field lists
    select by (`FieldEquals`) most, answered from an index."""

    label_key: str | None
    namespaced: bool
    keep: Callable[[Obj], Obj] = lambda obj: obj
    indexed: tuple[str, ...] | None = None


class CachedKubeApi:
    """`KubeApi` over a `KubernetesApi`, answering the lists of `selections` from informers once they are synced."""

    def __init__(self, api: KubernetesApi, selections: Mapping[Resource, Selection], max_informers: int = 24) -> None:
        self.api = api
        self.selections = dict(selections)
        self.max_informers = max_informers  # each holds one watch connection open
        self._informers: dict[tuple[Resource, str | None], Informer] = {}

    def informer(self, resource: Resource, namespace: str | None) -> Informer | None:
        return self._informers.get((resource, namespace))

    async def close(self) -> None:
        for informer in self._informers.values():
            await informer.stop()
        await self.api.close()

    async def list_objects(
        self,
        resource: Resource,
        namespace: str | None,
        label_selector: str = "",
        since: Obj | None = None,
        where: FieldEquals | None = None,
    ) -> list[Obj]:
        informer = self._informer_for(resource, namespace, label_selector)
        labels = equality_terms(label_selector)
        if informer is None or labels is None:
            return await self.api.list_objects(resource, namespace, label_selector, where=where)
        current = informer.synced
        if since is not None:
            try:
                async with asyncio.timeout(SINCE_WAIT_SECONDS):
                    await informer.wait_until_holds(since)
                current = True
            except TimeoutError:
                current = False
        if not current:
            return await self.api.list_objects(resource, namespace, label_selector, where=where)
        return informer.select(labels, where)

    def _informer_for(self, resource: Resource, namespace: str | None, label_selector: str) -> Informer | None:
        """The informer that answers this list (started on first use), or None when none does."""
        selection = self.selections.get(resource)
        labels = equality_terms(label_selector)
        if selection is None or labels is None or (selection.namespaced and namespace is None):
            return None
        if selection.label_key is not None and selection.label_key not in labels:
            return None
        scope = namespace if selection.namespaced else None
        informer = self._informers.get((resource, scope))
        if informer is None and len(self._informers) < self.max_informers:
            informer = Informer(self.api, resource, scope, selection.label_key, selection.keep, selection.indexed)
            self._informers[(resource, scope)] = informer
            informer.start()
        return informer

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        return await self.api.get(resource, namespace, name)

    async def create(self, resource: Resource, namespace: str, body: Obj) -> bool:
        return await self.api.create(resource, namespace, body)

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Obj | list[Obj],
        patch_type: PatchType = "merge",
        subresource: str | None = None,
    ) -> Obj | None:
        return await self.api.patch(resource, namespace, name, patch, patch_type, subresource)

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        return await self.api.delete(resource, namespace, name)

    async def post_event(self, namespace: str, body: Obj) -> None:
        await self.api.post_event(namespace, body)


def ownership_view(obj: Obj) -> Obj:
    """What deciding which policy governs a target reads of a KVPolicy (rollout/ownership.py)."""
    meta = obj.get("metadata") or {}
    kept = {key: meta[key] for key in ("name", "namespace", "uid", "generation", "creationTimestamp") if key in meta}
    return {"metadata": kept, "spec": {"targetRef": (obj.get("spec") or {}).get("targetRef")}}


def operator_selections(policy_label: str) -> dict[Resource, Selection]:
    """What the operator's observer lists on every pass: its children by policy label, the nodes' labels, and who
    governs which target (each policy's pass reads every policy of its namespace: without a cache, N policies cost
    N lists of N objects per period)."""
    children = Selection(policy_label, namespaced=True)
    return {
        PODS: children,
        SERVICES: children,
        JOBS: children,
        NODES: Selection(None, False, metadata_only),
        KVPOLICIES: Selection(None, True, ownership_view, indexed=TARGET_NAME_PATH),
    }
