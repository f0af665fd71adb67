"""`DevCluster`: the emulated API server, node pools and kubelet, served over HTTP on loopback, with a kubeconfig."""

from __future__ import annotations

import asyncio
import copy
import json
import tempfile
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp.web
import yaml

from kvpolicy_dev.devcluster.apiserver import EmulatedApiServer, Fault, WriteRecord
from kvpolicy_dev.devcluster.kubelet import Kubelet
from kvpolicy_dev.devcluster.nodes import CPU_POOL, NodePool, PodIpAllocator
from kvpolicy_dev.devcluster.resources import ResourceType
from kvpolicy_dev.devcluster.runners import ContainerRunner, SimulatorRunner
from kvpolicy_dev.devcluster.selectors import parse_label_selector
from kvpolicy_dev.devcluster.store import MERGE_PATCH, ApiError, Obj, Store

T = TypeVar("T")


def default_pools() -> list[NodePool]:
    """One single-node pool per GPU model the simulator knows, plus a CPU pool for everything else."""
    return [
        NodePool("h100", "NVIDIA-H100-80GB-HBM3"),
        NodePool("h200", "NVIDIA-H200"),
        NodePool("b200", "NVIDIA-B200"),
        NodePool("a100", "NVIDIA-A100-SXM4-80GB"),
        NodePool("l40s", "NVIDIA-L40S"),
        NodePool(CPU_POOL, None),
    ]


def kubeconfig_text(server_url: str, namespace: str = "default") -> str:
    """A kubeconfig every client understands (kubectl, helm, kopf, the kubernetes library)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "devcluster", "cluster": {"server": server_url}}],
        "users": [{"name": "devcluster", "user": {"token": "devcluster"}}],
        "contexts": [
            {"name": "devcluster", "context": {"cluster": "devcluster", "user": "devcluster", "namespace": namespace}}
        ],
        "current-context": "devcluster",
    }
    return yaml.safe_dump(config, sort_keys=False)


class DevCluster:
    """An emulated Kubernetes cluster on this machine; use as `async with DevCluster() as cluster:`.

    It runs on the current event loop. The object helpers below act on the store directly (no HTTP), are atomic
    and return copies. For sync code, other threads or other event loops use `ThreadedDevCluster`.
    """

    def __init__(
        self,
        *,
        pools: Sequence[NodePool] | None = None,
        runner: ContainerRunner | None = None,
        namespaces: Sequence[str] = ("default",),
        workdir: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.pools = {pool.name: pool for pool in (default_pools() if pools is None else pools)}
        self._initial_capacity = {name: pool.capacity_pods for name, pool in self.pools.items()}
        self._namespaces = list(namespaces)
        self._requested_workdir = workdir
        self._port = port
        self.store = Store()
        self.api = EmulatedApiServer(store=self.store)
        self._runner = runner if runner is not None else SimulatorRunner()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._http: aiohttp.web.ServerRunner | None = None
        self._url: str | None = None
        self._kubelet: Kubelet | None = None
        self._kubelet_task: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        # The cluster's contents first: a bad pool fails here, before anything needs cleaning up.
        for namespace in self._namespaces:
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        nodes = self.store.type_for("v1", "Node")
        for pool in self.pools.values():
            for node in pool.node_objects():
                status = node.pop("status")
                self.store.replace(
                    nodes, None, node["metadata"]["name"], {**self.create(node), "status": status}, "status"
                )
        if self._requested_workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpolicy-devcluster-")
        self.workdir = Path(self._tmp.name if self._tmp else str(self._requested_workdir))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._kubelet = Kubelet(self.store, self.pools, self._runner, self.workdir, PodIpAllocator())
        self.api.pod_log_reader = self._kubelet.read_log
        await self.api.__aenter__()
        try:
            # aiohttp's own server rather than kmock.Server: that one also patches aiohttp's DNS resolution
            # process-wide, which breaks when clusters in different threads stop out of order.
            server = aiohttp.web.Server(self.api, handler_cancellation=True)
            self._http = aiohttp.web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
            await self._http.setup()
            await aiohttp.web.TCPSite(self._http, "127.0.0.1", self._port or 0).start()
            host, port = self._http.addresses[0][:2]
            self._url = f"http://{host}:{port}"
            self.kubeconfig.write_text(kubeconfig_text(self._url))
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        self._kubelet_task = asyncio.create_task(self._kubelet.run())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.api.close_watches()
        if self._kubelet_task is not None:
            self._kubelet_task.cancel()
            await asyncio.gather(self._kubelet_task, return_exceptions=True)
        if self._http is not None:
            await self._http.cleanup()
        await self.api.__aexit__(exc_type, exc, traceback)
        if self._tmp is not None:
            self._tmp.cleanup()

    @property
    def url(self) -> str:
        """The API server's base URL, e.g. http://127.0.0.1:PORT."""
        if self._url is None:
            raise RuntimeError("the cluster is not started: use `async with DevCluster() as cluster`")
        return self._url

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def kubelet(self) -> Kubelet:
        if self._kubelet is None:
            raise RuntimeError("the cluster is not started: use `async with DevCluster() as cluster`")
        return self._kubelet

    def environ(self) -> dict[str, str]:
        """Environment variables that point kubectl, helm, kopf and the kubernetes library at this cluster."""
        return {"KUBECONFIG": str(self.kubeconfig)}

    # --- scenario controls ----------------------------------------------------------------------------------------

    def set_pool_capacity(self, pool: str, capacity_pods: int | None) -> None:
        """How many GPU pods fit in a pool from now on (None: no cap); pending pods are retried."""
        self.kubelet.set_capacity(pool, capacity_pods)

    def reset_pool_capacities(self) -> None:
        for pool, capacity in self._initial_capacity.items():
            self.kubelet.set_capacity(pool, capacity)

    def set_runner(self, runner: ContainerRunner) -> ContainerRunner:
        """Use another container runner for pods started from now on; returns the previous one."""
        previous, self.kubelet.runner = self.kubelet.runner, runner
        return previous

    def set_private_registry(self, prefix: str, secret: str | None) -> None:
        """Images starting with `prefix` pull only for pods whose imagePullSecrets name `secret` (an existing
        Secret of their namespace); others stay in ErrImagePull/ImagePullBackOff. None: a public registry again."""
        if secret is None:
            self.kubelet.private_registries.pop(prefix, None)
        else:
            self.kubelet.private_registries[prefix] = secret
        self.store.notify()

    def fail_next(self, times: int, code: int, **match: str) -> Fault:
        """Fail the next `times` matching API requests with `code`; see `EmulatedApiServer.fail_next`."""
        return self.api.fail_next(times, code, **match)

    def outage(self, code: int = 503, **match: str | None) -> Fault:
        """Matching requests fail with `code`, open watches end, until `end_fault`: see `EmulatedApiServer.outage`."""
        return self.api.outage(code, **match)

    def end_fault(self, fault: Fault) -> None:
        self.api.end_fault(fault)

    def clear_faults(self) -> None:
        self.api.clear_faults()

    def accept_tokens(self, tokens: frozenset[str] | None) -> None:
        """Answer 401 to requests without one of these bearer tokens from now on (None: accept everything)."""
        self.api.accept_tokens(tokens)

    def writes(self) -> tuple[WriteRecord, ...]:
        """The API server's write log: every create, update, patch and delete it answered, in order."""
        return self.api.writes

    def rewrite_service_urls(self, text: str, namespace: str) -> str:
        """Service URLs in `text` -> ready pod IP:port, as pods of this cluster would reach them."""
        return self.kubelet.rewrite_service_urls(text, namespace)

    # --- objects (no HTTP; atomic; return copies) -----------------------------------------------------------------

    def resource(self, api_version: str, kind: str) -> ResourceType:
        return self.store.type_for(api_version, kind)

    def create(self, obj: Mapping[str, Any]) -> Obj:
        rt = self.resource(obj["apiVersion"], obj["kind"])
        return copy.deepcopy(self.store.create(rt, obj.get("metadata", {}).get("namespace"), obj))

    def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Create the object, or merge-patch it into the existing one."""
        rt = self.resource(obj["apiVersion"], obj["kind"])
        meta = obj.get("metadata", {})
        if self.store.find(rt, meta.get("namespace"), meta["name"]) is None:
            return self.create(obj)
        return copy.deepcopy(self.store.patch(rt, meta.get("namespace"), meta["name"], MERGE_PATCH, obj))

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj:
        return copy.deepcopy(self.store.get(self.resource(api_version, kind), namespace, name))

    def find(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        return copy.deepcopy(self.store.find(self.resource(api_version, kind), namespace, name))

    def list(self, api_version: str, kind: str, namespace: str | None = None, label_selector: str = "") -> list[Obj]:
        selector = parse_label_selector(label_selector) if label_selector else None
        return copy.deepcopy(self.store.list_objects(self.resource(api_version, kind), namespace, selector))

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> Obj:
        rt = self.resource(api_version, kind)
        return copy.deepcopy(self.store.patch(rt, namespace, name, MERGE_PATCH, patch, subresource))

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj:
        return copy.deepcopy(self.store.delete(self.resource(api_version, kind), namespace, name))

    def purge_namespace(self, namespace: str) -> None:
        """Delete a namespace and everything in it, finalizers or not (no operator may be left to release them)."""
        if self.store.find(self.resource("v1", "Namespace"), None, namespace) is not None:
            self.store.delete(self.resource("v1", "Namespace"), None, namespace)
        for rt, obj in list(self.store.all_objects()):
            if rt.namespaced and obj["metadata"].get("namespace") == namespace:
                name = obj["metadata"]["name"]
                self.store.patch(rt, namespace, name, MERGE_PATCH, {"metadata": {"finalizers": None}})
                if self.store.find(rt, namespace, name) is not None:
                    self.store.delete(rt, namespace, name)

    async def wait_for(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        condition: Callable[[Obj], bool] = lambda obj: True,
        give_up_after: float = 60.0,
    ) -> Obj:
        """Wait until the object exists and `condition(obj)` holds; TimeoutError shows the last state seen."""
        rt = self.resource(api_version, kind)
        obj: Obj | None = None
        try:
            async with asyncio.timeout(give_up_after):
                while True:
                    seen = self.store.resource_version
                    obj = self.store.find(rt, namespace, name)
                    if obj is not None and condition(obj):
                        return copy.deepcopy(obj)
                    await self.store.wait_for_change(seen)
        except TimeoutError:
            state = json.dumps(obj, indent=1)[:4000] if obj is not None else "absent"
            raise TimeoutError(
                f"{kind} {namespace or ''}/{name}: condition not met in {give_up_after}s; last: {state}"
            ) from None

    async def wait_deleted(
        self, api_version: str, kind: str, name: str, namespace: str | None = None, give_up_after: float = 60.0
    ) -> None:
        rt = self.resource(api_version, kind)
        async with asyncio.timeout(give_up_after):
            while True:
                seen = self.store.resource_version
                if self.store.find(rt, namespace, name) is None:
                    return
                await self.store.wait_for_change(seen)


class ThreadedDevCluster:
    """A `DevCluster` on its own event loop in a background thread.

    It serves sync tests, kopf's `KopfRunner` (which runs the operator in yet another thread) and async tests on any
    loop (looptime included: the cluster keeps real time). Its methods run on the cluster's loop and may be called
    from any thread; the `a*` variants are awaitable from another event loop.
    """

    def __init__(self, **options: Any) -> None:
        self.cluster = DevCluster(**options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._running = False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="devcluster", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the dev cluster did not start within {timeout}s")
        if self._failure is not None:
            raise RuntimeError("the dev cluster failed to start") from self._failure

    def stop(self) -> None:
        """Shut the cluster down; raises if it failed while running or stopping (a start failure raised already)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None and self._running:
            raise RuntimeError("the dev cluster failed") from self._failure

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with self.cluster:
                self._running = True
                self._started.set()
                await self._stop.wait()
        except Exception as exc:  # handed to start() or stop(), in the caller's thread
            self._failure = exc
        finally:
            self._started.set()

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> Awaitable[T]:
        if self._loop is None:
            raise RuntimeError("the dev cluster is not started")
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the cluster's loop and wait for its result (from a thread without a running loop)."""
        if self._loop is None:
            raise RuntimeError("the dev cluster is not started")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def arun(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the cluster's loop, awaited from another event loop."""
        return await self._submit(coroutine)

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call a function of the cluster on the cluster's loop (where the state lives) and return its result."""

        async def call() -> T:
            return function(*args, **kwargs)

        return self.run(call())

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    def environ(self) -> dict[str, str]:
        return self.cluster.environ()

    def create(self, obj: Mapping[str, Any]) -> Obj:
        return self.call(self.cluster.create, obj)

    def apply(self, obj: Mapping[str, Any]) -> Obj:
        return self.call(self.cluster.apply, obj)

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj:
        return self.call(self.cluster.get, api_version, kind, name, namespace)

    def find(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        return self.call(self.cluster.find, api_version, kind, name, namespace)

    def list(self, api_version: str, kind: str, namespace: str | None = None, label_selector: str = "") -> list[Obj]:
        return self.call(self.cluster.list, api_version, kind, namespace, label_selector)

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> Obj:
        return self.call(self.cluster.patch, api_version, kind, name, patch, namespace, subresource)

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj:
        return self.call(self.cluster.delete, api_version, kind, name, namespace)

    def purge_namespace(self, namespace: str) -> None:
        self.call(self.cluster.purge_namespace, namespace)

    def set_pool_capacity(self, pool: str, capacity_pods: int | None) -> None:
        self.call(self.cluster.set_pool_capacity, pool, capacity_pods)

    def set_runner(self, runner: ContainerRunner) -> ContainerRunner:
        return self.call(self.cluster.set_runner, runner)

    def set_private_registry(self, prefix: str, secret: str | None) -> None:
        self.call(self.cluster.set_private_registry, prefix, secret)

    def fail_next(self, times: int, code: int, **match: str) -> Fault:
        return self.call(self.cluster.fail_next, times, code, **match)

    def outage(self, code: int = 503, **match: str | None) -> Fault:
        return self.call(self.cluster.outage, code, **match)

    def end_fault(self, fault: Fault) -> None:
        self.call(self.cluster.end_fault, fault)

    def clear_faults(self) -> None:
        self.call(self.cluster.clear_faults)

    def accept_tokens(self, tokens: frozenset[str] | None) -> None:
        self.call(self.cluster.accept_tokens, tokens)

    def writes(self) -> tuple[WriteRecord, ...]:
        return self.call(self.cluster.writes)

    def rewrite_service_urls(self, text: str, namespace: str) -> str:
        return self.call(self.cluster.rewrite_service_urls, text, namespace)

    def wait_for(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        condition: Callable[[Obj], bool] = lambda obj: True,
        give_up_after: float = 60.0,
    ) -> Obj:
        return self.run(self.cluster.wait_for(api_version, kind, name, namespace, condition, give_up_after))

    async def await_for(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        condition: Callable[[Obj], bool] = lambda obj: True,
        give_up_after: float = 60.0,
    ) -> Obj:
        return await self.arun(self.cluster.wait_for(api_version, kind, name, namespace, condition, give_up_after))

    def wait_deleted(
        self, api_version: str, kind: str, name: str, namespace: str | None = None, give_up_after: float = 60.0
    ) -> None:
        self.run(self.cluster.wait_deleted(api_version, kind, name, namespace, give_up_after))


__all__ = ["ApiError", "DevCluster", "ThreadedDevCluster", "default_pools", "kubeconfig_text"]
