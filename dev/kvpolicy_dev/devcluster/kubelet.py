"""The kubelet stand-in: Deployment, ReplicaSet and Job controllers, a scheduler over node pools, pod processes.

It works on the `Store` directly (same event loop, no HTTP) and is level-triggered: after every change in the cluster
it reconciles everything once more; a pass that changes nothing writes nothing, so it settles.
Long-running pods (restartPolicy Always) run what the `ContainerRunner` picks, and count ready once `/health` answers.
Run-to-completion pods (Never/OnFailure, i.e. Jobs) run their container's command+args.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kvpolicy.gate_programs.report import TERMINATION_LOG_ENV, TERMINATION_LOG_LIMIT

from kvpolicy_dev.devcluster import kserve, leaderworkerset
from kvpolicy_dev.devcluster.kserve import LLMInferenceServiceController
from kvpolicy_dev.devcluster.leaderworkerset import LeaderWorkerSetController
from kvpolicy_dev.devcluster.nodes import (
    POOL_LABEL,
    NodePool,
    PodIpAllocator,
    counts_against_capacity,
    schedule,
    unresolved_service_urls,
)
from kvpolicy_dev.devcluster.nodes import rewrite_service_urls as rewrite_urls
from kvpolicy_dev.devcluster.resources import ResourceType
from kvpolicy_dev.devcluster.runners import ContainerRunner, container_port
from kvpolicy_dev.devcluster.store import MERGE_PATCH, ApiError, Obj, Store, now_timestamp

logger = logging.getLogger(__name__)

# Pod processes run in their own sessions, so they would outlive an interpreter that exits without shutting the
# cluster down (a crash, a daemon thread cut short): kill whatever is left at exit.
_live_process_groups: set[int] = set()


@atexit.register
def _kill_stray_process_groups() -> None:
    for process_group in list(_live_process_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process_group, signal.SIGKILL)


HASH_LABEL = "pod-template-hash"
HEALTH_POLL_SECONDS = 0.05
STOP_GRACE_SECONDS = 3.0
LOG_READ_LIMIT = 1 << 20
LOG_TAIL_ON_FAILURE = 2000
TERMINAL_PHASES = ("Succeeded", "Failed")


def template_hash(template: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def with_condition(
    conditions: Sequence[Mapping[str, Any]], type_: str, status: str, reason: str = "", message: str = ""
) -> list[dict[str, Any]]:
    """Set one condition; its lastTransitionTime changes only when its status does (so passes settle)."""
    result: list[dict[str, Any]] = []
    new = {"type": type_, "status": status, "reason": reason, "message": message}
    for condition in conditions:
        if condition.get("type") == type_:
            same = condition.get("status") == status
            new["lastTransitionTime"] = (
                str(condition.get("lastTransitionTime") or now_timestamp()) if same else now_timestamp()
            )
            result.append(new)
        else:
            result.append(dict(condition))
    if not any(condition.get("type") == type_ for condition in conditions):
        result.append({**new, "lastTransitionTime": now_timestamp()})
    return result


def is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def job_argv(container: Mapping[str, Any]) -> list[str]:
    argv = [str(part) for part in (container.get("command") or []) + (container.get("args") or [])]
    if not argv:
        raise ValueError("the container has no command: the dev cluster cannot run an image's entrypoint")
    if argv[0] == "kvpolicy":
        return [sys.executable, "-m", "kvpolicy", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return argv


@dataclass
class PodRuntime:
    """What the kubelet runs for one pod (keyed by uid: a re-created pod of the same name is another pod)."""

    uid: str
    namespace: str
    name: str
    ip: str
    directory: Path
    process: asyncio.subprocess.Process | None = None
    task: asyncio.Task[None] | None = None
    stopping: bool = False

    @property
    def log_path(self) -> Path:
        return self.directory / "container.log"

    @property
    def termination_log(self) -> Path:
        return self.directory / "termination-log"


@dataclass
class Kubelet:
    store: Store
    pools: dict[str, NodePool]
    runner: ContainerRunner
    workdir: Path
    ips: PodIpAllocator = field(default_factory=PodIpAllocator)
    restart_backoff_seconds: float = 0.2
    service_wait_seconds: float = 10.0
    # Images under these prefixes pull only with an imagePullSecrets entry naming the Secret given (a private registry).
    private_registries: dict[str, str] = field(default_factory=dict)
    # The LeaderWorkerSet controller's stand-in: pods for the sets of the CRD, once installed (leaderworkerset.py).
    leaderworkersets: LeaderWorkerSetController = field(default_factory=LeaderWorkerSetController)
    # KServe's LLMInferenceService controller's stand-in: a workload Deployment per service, routing group status.
    llminferenceservices: LLMInferenceServiceController = field(default_factory=LLMInferenceServiceController)
    _runtimes: dict[str, PodRuntime] = field(default_factory=dict, init=False)
    _job_started: dict[str, float] = field(default_factory=dict, init=False)
    _first_seen: dict[str, float] = field(default_factory=dict, init=False)
    _stopping_tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _http: aiohttp.ClientSession | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._deployments = self.store.find_type("apps", "v1", "deployments")
        self._replica_sets = self.store.find_type("apps", "v1", "replicasets")
        self._jobs = self.store.find_type("batch", "v1", "jobs")
        self._pods = self.store.find_type("", "v1", "pods")
        self._nodes = self.store.find_type("", "v1", "nodes")
        self._services = self.store.find_type("", "v1", "services")
        watched = (self._deployments, self._replica_sets, self._jobs, self._pods, self._nodes, self._services)
        # Secrets and ConfigMaps too: pods wait for the image pull Secrets and the env sources they name. And the
        # kinds the controller stand-ins below run (their CRDs may be installed later).
        self._kinds = {rt.key for rt in watched} | {("", "secrets"), ("", "configmaps")}
        self._kinds |= {(leaderworkerset.GROUP, leaderworkerset.PLURAL), (kserve.GROUP, kserve.PLURAL)}

    # --- lifecycle ------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Reconcile after every change to what it runs until cancelled; then stop every pod process."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        loop = asyncio.get_running_loop()
        try:
            while True:
                seen = self.store.resource_version
                wake_in = self._reconcile_safely()
                due = None if wake_in is None else loop.time() + wake_in
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(due):
                        await self.store.wait_for_change(seen)
                        while not self._concerned_since(seen):
                            seen = self.store.resource_version
                            await self.store.wait_for_change(seen)
        finally:
            await self.shutdown()

    def _concerned_since(self, seen: int) -> bool:
        """Whether something this kubelet acts on changed after `seen`, or a test control woke it without a write.
        Writes of other kinds (KVPolicies, Events, Leases) need no pass: with thousands of policies, a pass over every
        Deployment after each of their writes made the emulator quadratic in the number of policies."""
        if self.store.resource_version == seen:
            return True
        try:
            events = self.store.events_since(seen)
        except ApiError:  # fell out of the log: look at everything
            return True
        return any(event.key in self._kinds for event in events)

    async def shutdown(self) -> None:
        runtimes = list(self._runtimes.values())
        self._runtimes.clear()
        await asyncio.gather(*(self._stop(runtime) for runtime in runtimes), *self._stopping_tasks)
        if self._http is not None:
            await self._http.close()
            self._http = None

    def set_capacity(self, pool: str, capacity_pods: int | None) -> None:
        if pool not in self.pools:
            raise KeyError(f"no node pool {pool!r}; pools: {', '.join(self.pools)}")
        self.pools[pool].capacity_pods = capacity_pods
        self.store.notify()  # pending pods may fit now

    def read_log(self, namespace: str, name: str) -> str:
        for runtime in self._runtimes.values():
            if (runtime.namespace, runtime.name) == (namespace, name):
                return self._log_tail(runtime, LOG_READ_LIMIT)
        return ""

    def rewrite_service_urls(self, text: str, namespace: str) -> str:
        return rewrite_urls(
            text, namespace, self.store.list_objects(self._services), self.store.list_objects(self._pods)
        )

    # --- reconciliation -------------------------------------------------------------------------------------------

    def _reconcile_safely(self) -> float | None:
        try:
            return self.reconcile()
        except Exception:  # a bug must not stop the kubelet; the next change retries
            logger.exception("dev cluster kubelet: reconcile failed")
            return 1.0

    def reconcile(self) -> float | None:
        """One pass over everything; returns how soon a time-based step (a Job deadline) is due, if any."""
        wakes = [self._isolated(self._reconcile_deployment, dep) for dep in self.store.list_objects(self._deployments)]
        wakes += [self._isolated(self._reconcile_replica_set, rs) for rs in self.store.list_objects(self._replica_sets)]
        jobs = self.store.list_objects(self._jobs)
        wakes += [self._isolated(self._reconcile_job, job) for job in jobs]
        for uid in self._job_started.keys() - {job["metadata"]["uid"] for job in jobs}:
            del self._job_started[uid]
        self.leaderworkersets.reconcile(self.store)
        self.llminferenceservices.reconcile(self.store)
        wakes.append(self._reconcile_pods())
        due = [wake for wake in wakes if wake is not None]
        return max(0.0, min(due)) if due else None

    @staticmethod
    def _isolated(reconcile: Callable[[Obj], float | None], obj: Obj) -> float | None:
        """One object's failure (a bad spec, a race with its deletion) must not hold up the others."""
        try:
            return reconcile(obj)
        except Exception:
            meta = obj["metadata"]
            logger.exception("dev cluster kubelet: %s %s/%s failed", obj["kind"], meta.get("namespace"), meta["name"])
            return 1.0

    def _create_pod(self, owner: Obj, template: Mapping[str, Any], labels: Mapping[str, str]) -> None:
        """A pod named as the ReplicaSet and Job controllers name theirs: generateName `<owner>-` (the API server cuts
        it to 58 characters and appends 5 random ones)."""
        template_meta = template.get("metadata") or {}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{owner['metadata']['name']}-",
                "labels": {**(template_meta.get("labels") or {}), **labels},
                "annotations": dict(template_meta.get("annotations") or {}),
                "ownerReferences": [self._owner_reference(owner)],
            },
            "spec": copy.deepcopy(template.get("spec") or {}),
        }
        self.store.create(self._pods, owner["metadata"]["namespace"], pod)

    @staticmethod
    def _owner_reference(owner: Obj) -> dict[str, Any]:
        meta = owner["metadata"]
        return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
                "controller": True, "blockOwnerDeletion": True}  # fmt: skip

    def _delete_pod(self, pod: Obj) -> None:
        with contextlib.suppress(ApiError):
            self.store.delete(self._pods, pod["metadata"]["namespace"], pod["metadata"]["name"])

    def _write_status(self, rt_obj: Obj, status: dict[str, Any]) -> None:
        if rt_obj.get("status") != status:
            rt = self.store.type_for(rt_obj["apiVersion"], rt_obj["kind"])
            meta = rt_obj["metadata"]
            self.store.replace(rt, meta.get("namespace"), meta["name"], {**rt_obj, "status": status}, "status")

    def _owned(self, rt: ResourceType, owner: Obj) -> list[Obj]:
        uid = owner["metadata"]["uid"]
        objects = self.store.list_objects(rt, owner["metadata"]["namespace"])
        return [obj for obj in objects if owned_by(obj, uid) and not obj["metadata"].get("deletionTimestamp")]

    def _reconcile_deployment(self, deployment: Obj) -> float | None:
        """Keep one ReplicaSet per pod template; the old ones go to 0 replicas once the new one is ready."""
        if deployment["metadata"].get("deletionTimestamp"):
            return None
        spec = deployment.get("spec") or {}
        template = spec.get("template") or {}
        desired = int(spec.get("replicas", 1))
        pod_hash = template_hash(template)
        replica_sets = self._owned(self._replica_sets, deployment)
        current = next((rs for rs in replica_sets if rs["metadata"]["labels"].get(HASH_LABEL) == pod_hash), None)
        if current is None:
            current = self._create_replica_set(deployment, template, pod_hash, desired)
        elif current["spec"].get("replicas") != desired:
            current = self._scale(current, desired)
        old = [rs for rs in replica_sets if rs["metadata"]["uid"] != current["metadata"]["uid"]]
        recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
        if recreate or sum(map(is_ready, self._owned(self._pods, current))) >= desired:
            for rs in old:
                if rs["spec"].get("replicas") != 0:
                    self._scale(rs, 0)
        self._write_deployment_status(deployment, desired, current)
        return None

    def _create_replica_set(self, deployment: Obj, template: Mapping[str, Any], pod_hash: str, replicas: int) -> Obj:
        pod_template: dict[str, Any] = copy.deepcopy(dict(template))
        pod_template.setdefault("metadata", {}).setdefault("labels", {})[HASH_LABEL] = pod_hash
        selector = copy.deepcopy(deployment["spec"].get("selector") or {})
        selector.setdefault("matchLabels", {})[HASH_LABEL] = pod_hash
        replica_set = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{deployment['metadata']['name']}-{pod_hash}",
                "labels": dict(pod_template["metadata"]["labels"]),
                "ownerReferences": [self._owner_reference(deployment)],
            },
            "spec": {"replicas": replicas, "selector": selector, "template": pod_template},
        }
        return self.store.create(self._replica_sets, deployment["metadata"]["namespace"], replica_set)

    def _scale(self, replica_set: Obj, replicas: int) -> Obj:
        meta = replica_set["metadata"]
        return self.store.patch(self._replica_sets, meta["namespace"], meta["name"], MERGE_PATCH,
                                {"spec": {"replicas": replicas}})  # fmt: skip

    def _reconcile_replica_set(self, replica_set: Obj) -> float | None:
        if replica_set["metadata"].get("deletionTimestamp"):
            return None
        spec = replica_set.get("spec") or {}
        desired = int(spec.get("replicas", 1))
        pods = self._owned(self._pods, replica_set)
        for _ in range(desired - len(pods)):
            self._create_pod(replica_set, spec.get("template") or {}, {})
        # Scale down the pods least far along first: unready, then newest.
        surplus = sorted(pods, key=lambda pod: (is_ready(pod), pod["metadata"]["creationTimestamp"]))
        for pod in surplus[: max(0, len(pods) - desired)]:
            self._delete_pod(pod)
        pods = self._owned(self._pods, replica_set)
        ready = sum(map(is_ready, pods))
        status = {
            "replicas": len(pods),
            "fullyLabeledReplicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": replica_set["metadata"].get("generation", 1),
        }
        self._write_status(replica_set, status)
        return None

    def _write_deployment_status(self, deployment: Obj, desired: int, current: Obj) -> None:
        pods = [pod for rs in self._owned(self._replica_sets, deployment) for pod in self._owned(self._pods, rs)]
        updated = self._owned(self._pods, current)
        ready = sum(map(is_ready, pods))
        updated_ready = sum(map(is_ready, updated))
        status = copy.deepcopy(deployment.get("status") or {})
        replica_set = f'ReplicaSet "{current["metadata"]["name"]}"'
        available = ready >= desired
        complete = updated_ready >= desired and len(pods) == len(updated) == desired
        conditions = with_condition(
            status.get("conditions") or [],
            "Available",
            "True" if available else "False",
            "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
            "Deployment has minimum availability." if available else "Deployment does not have minimum availability.",
        )
        conditions = with_condition(
            conditions,
            "Progressing",
            "True",
            "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated",
            f"{replica_set} has successfully progressed." if complete else f"{replica_set} is progressing.",
        )
        status.update(
            observedGeneration=deployment["metadata"].get("generation", 1),
            replicas=len(pods),
            updatedReplicas=len(updated),
            readyReplicas=ready,
            availableReplicas=ready,
            unavailableReplicas=max(0, desired - ready),
            conditions=conditions,
        )
        self._write_status(deployment, status)

    def _reconcile_job(self, job: Obj) -> float | None:
        status = copy.deepcopy(job.get("status") or {})
        finished = any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if finished or job["metadata"].get("deletionTimestamp"):
            return None
        spec = job.get("spec") or {}
        uid = job["metadata"]["uid"]
        started = self._job_started.setdefault(uid, time.monotonic())
        pods = self._owned(self._pods, job)
        succeeded = sum(pod.get("status", {}).get("phase") == "Succeeded" for pod in pods)
        failed = sum(pod.get("status", {}).get("phase") == "Failed" for pod in pods)
        active = [pod for pod in pods if pod.get("status", {}).get("phase") not in TERMINAL_PHASES]
        deadline = spec.get("activeDeadlineSeconds")
        remaining = None if deadline is None else started + float(deadline) - time.monotonic()
        status.setdefault("startTime", now_timestamp())
        conditions = status.get("conditions") or []
        wake: float | None = None
        if succeeded:
            conditions = with_condition(conditions, "Complete", "True")
            status["completionTime"] = now_timestamp()
        elif failed > int(spec.get("backoffLimit", 6)):
            message = "Job has reached the specified backoff limit"
            conditions = with_condition(conditions, "Failed", "True", "BackoffLimitExceeded", message)
        elif remaining is not None and remaining <= 0:
            for pod in active:
                self._fail_pod(pod, "DeadlineExceeded", "Pod was active longer than the Job's activeDeadlineSeconds")
            message = "Job was active longer than specified deadline"
            conditions = with_condition(conditions, "Failed", "True", "DeadlineExceeded", message)
            active = []
        else:
            if not active:
                name = job["metadata"]["name"]
                labels = {"job-name": name, "batch.kubernetes.io/job-name": name, "controller-uid": uid}
                self._create_pod(job, spec.get("template") or {}, labels)
                active = [{}]
            wake = remaining
        status.update(active=len(active), succeeded=succeeded, failed=failed, conditions=conditions)
        status["ready"] = sum(map(is_ready, active))
        self._write_status(job, status)
        return wake

    def _fail_pod(self, pod: Obj, reason: str, message: str) -> None:
        runtime = self._runtimes.get(pod["metadata"]["uid"])
        if runtime is not None:
            self._stop_later(runtime)
        status = copy.deepcopy(pod.get("status") or {})
        status.update(phase="Failed", reason=reason, message=message)
        status["conditions"] = with_condition(status.get("conditions") or [], "Ready", "False", reason)
        self._write_status(pod, status)

    def _reconcile_pods(self) -> float | None:
        nodes = self.store.list_objects(self._nodes)
        node_pools = {node["metadata"]["name"]: node["metadata"]["labels"].get(POOL_LABEL, "") for node in nodes}
        pods = self.store.list_objects(self._pods)
        used: dict[str, int] = {}
        for pod in pods:
            node_name = pod.get("spec", {}).get("nodeName")
            if (
                node_name
                and counts_against_capacity(pod["spec"])
                and pod.get("status", {}).get("phase") not in TERMINAL_PHASES
            ):
                used[node_pools.get(node_name, "")] = used.get(node_pools.get(node_name, ""), 0) + 1
        live_uids = {pod["metadata"]["uid"] for pod in pods}
        for uid in [uid for uid in self._runtimes if uid not in live_uids]:
            self._stop_later(self._runtimes.pop(uid))
        for uid in [uid for uid in self._first_seen if uid not in live_uids]:
            del self._first_seen[uid]
        wakes: list[float] = []
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp") or pod.get("status", {}).get("phase") in TERMINAL_PHASES:
                continue
            if not pod.get("spec", {}).get("nodeName"):
                self._schedule(pod, nodes, used, node_pools)
            elif pod["metadata"]["uid"] not in self._runtimes:
                node = next((n for n in nodes if n["metadata"]["name"] == pod["spec"]["nodeName"]), None)
                if node is None:
                    self._node_missing(pod)
                elif self._image_pull_failed(pod):
                    continue
                elif (wait := self._wait_for_services(pod)) is not None:
                    wakes.append(wait)
                else:
                    self._isolated(functools.partial(self._start, node=node), pod)
        return min(wakes) if wakes else None

    def _wait_for_services(self, pod: Obj) -> float | None:
        """Hold a Job's pod whose Service URLs cannot reach a ready pod yet, for up to `service_wait_seconds`.

        On a real cluster DNS and a few seconds of container start hide the order in which a Job and the Service
        it calls appear; here a process starts within milliseconds, so it waits for them instead. Returns how
        long to wait before looking again, or None to start the pod now.
        """
        if pod["spec"].get("restartPolicy", "Always") not in ("Never", "OnFailure"):
            return None
        container = (pod["spec"].get("containers") or [{}])[0]
        texts = [str(variable.get("value", "")) for variable in container.get("env") or []]
        texts += [str(part) for part in (container.get("command") or []) + (container.get("args") or [])]
        namespace = pod["metadata"]["namespace"]
        services, pods = self.store.list_objects(self._services), self.store.list_objects(self._pods)
        unresolved = [url for text in texts for url in unresolved_service_urls(text, namespace, services, pods)]
        first_seen = self._first_seen.setdefault(pod["metadata"]["uid"], time.monotonic())
        remaining = first_seen + self.service_wait_seconds - time.monotonic()
        if not unresolved or remaining <= 0:
            return None
        status = copy.deepcopy(pod.get("status") or {})
        status.setdefault("phase", "Pending")
        waiting = {"reason": "ContainerCreating", "message": f"waiting for a ready pod behind {unresolved[0]}"}
        status["containerStatuses"] = [self._container_status(container, False, {"waiting": waiting})]
        self._write_status(pod, status)
        return remaining

    def _image_pull_failed(self, pod: Obj) -> bool:
        """A container image of a private registry the pod has no pull Secret for: ErrImagePull, then
        ImagePullBackOff (and there it stays, as the real kubelet's back-off never succeeds either)."""
        namespace = pod["metadata"]["namespace"]
        secrets = self.store.find_type("", "v1", "secrets")
        offered = {ref.get("name") for ref in pod["spec"].get("imagePullSecrets") or []}
        usable = {name for name in offered if self.store.find(secrets, namespace, name) is not None}
        for container in pod["spec"].get("containers") or []:
            image = str(container.get("image", ""))
            needed = next((s for prefix, s in self.private_registries.items() if image.startswith(prefix)), None)
            if needed is None or needed in usable:
                continue
            statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
            was = ((statuses[0].get("state") or {}).get("waiting") or {}).get("reason")
            if was in ("ErrImagePull", "ImagePullBackOff"):
                waiting = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}
            else:
                waiting = {"reason": "ErrImagePull", "message": f'failed to pull and unpack image "{image}": pull '
                           "access denied, repository does not exist or may require authorization"}  # fmt: skip
            status = copy.deepcopy(pod.get("status") or {})
            status.setdefault("phase", "Pending")
            status["containerStatuses"] = [self._container_status(container, False, {"waiting": waiting})]
            self._write_status(pod, status)
            return True
        return False

    def _node_missing(self, pod: Obj) -> None:
        """A pod bound to a node that does not exist stays Pending, saying so (as on a real cluster)."""
        status = copy.deepcopy(pod.get("status") or {})
        status.setdefault("phase", "Pending")
        message = f"node {pod['spec']['nodeName']!r} does not exist"
        status["conditions"] = with_condition(status.get("conditions") or [], "Ready", "False", "NodeNotFound", message)
        self._write_status(pod, status)

    def _schedule(self, pod: Obj, nodes: list[Obj], used: dict[str, int], node_pools: dict[str, str]) -> None:
        node_name, why = schedule(pod["spec"], nodes, self.pools, used)
        status = copy.deepcopy(pod.get("status") or {})
        status.setdefault("phase", "Pending")
        if node_name is None:
            status["conditions"] = with_condition(
                status.get("conditions") or [], "PodScheduled", "False", "Unschedulable", why
            )
            self._write_status(pod, status)
            return
        if counts_against_capacity(pod["spec"]):
            used[node_pools[node_name]] = used.get(node_pools[node_name], 0) + 1
        meta = pod["metadata"]
        scheduled = self.store.replace(
            self._pods, meta["namespace"], meta["name"], {**pod, "spec": {**pod["spec"], "nodeName": node_name}}
        )
        status["conditions"] = with_condition(status.get("conditions") or [], "PodScheduled", "True")
        self._write_status(scheduled, status)

    # --- pod processes --------------------------------------------------------------------------------------------

    def _start(self, pod: Obj, node: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        directory = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        runtime = PodRuntime(meta["uid"], meta["namespace"], meta["name"], self.ips.allocate(), directory)
        self._runtimes[runtime.uid] = runtime
        container = (spec.get("containers") or [{}])[0]
        run_to_completion = spec.get("restartPolicy", "Always") in ("Never", "OnFailure")
        status = copy.deepcopy(pod.get("status") or {})
        status.update(
            phase="Running",
            podIP=runtime.ip,
            podIPs=[{"ip": runtime.ip}],
            hostIP="127.0.0.1",
            startTime=status.get("startTime", now_timestamp()),
        )
        try:
            env = self._environment(pod, container, runtime)
            if run_to_completion:
                argv: list[str] | None = [
                    self.rewrite_service_urls(arg, meta["namespace"]) for arg in job_argv(container)
                ]
            else:
                argv = self.runner.argv(container, node["metadata"]["labels"], runtime.ip)
        except (ValueError, LookupError) as exc:
            status.update(phase="Pending")
            status["containerStatuses"] = [
                self._container_status(
                    container, False, {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                )
            ]
            self._write_status(pod, status)
            return
        status["containerStatuses"] = [
            self._container_status(container, argv is None, {"running": {"startedAt": now_timestamp()}})
        ]
        status["conditions"] = with_condition(status.get("conditions") or [], "Ready", "False" if argv else "True")
        self._write_status(pod, status)
        if argv is not None:
            runtime.task = asyncio.create_task(self._supervise(runtime, argv, env, container, run_to_completion))

    @staticmethod
    def _container_status(
        container: Mapping[str, Any], ready: bool, state: dict[str, Any], restarts: int = 0
    ) -> dict[str, Any]:
        return {
            "name": container.get("name", "main"),
            "image": container.get("image", ""),
            "ready": ready,
            "started": "running" in state,
            "restartCount": restarts,
            "state": state,
        }

    def _environment(self, pod: Obj, container: Mapping[str, Any], runtime: PodRuntime) -> dict[str, str]:
        env = dict(os.environ)
        env[TERMINATION_LOG_ENV] = str(runtime.termination_log)
        for variable in container.get("env") or []:
            if "valueFrom" in variable:
                value = self._env_value_from(pod, variable["valueFrom"], runtime)
            else:
                value = str(variable.get("value", ""))
            env[variable["name"]] = self.rewrite_service_urls(value, pod["metadata"]["namespace"])
        return env

    def _env_value_from(self, pod: Obj, source: Mapping[str, Any], runtime: PodRuntime) -> str:
        namespace = pod["metadata"]["namespace"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {
                "metadata.name": runtime.name,
                "metadata.namespace": namespace,
                "status.podIP": runtime.ip,
                "spec.nodeName": pod["spec"].get("nodeName", ""),
            }
            if path not in fields:
                raise ValueError(f"env fieldRef {path!r} is not supported; use one of {sorted(fields)}")
            return str(fields[path])
        for kind, plural in (("configMapKeyRef", "configmaps"), ("secretKeyRef", "secrets")):
            if kind in source:
                ref = source[kind]
                obj = self.store.find(self.store.find_type("", "v1", plural), namespace, ref["name"])
                data = (obj or {}).get("data") or {}
                if ref["key"] not in data:
                    raise LookupError(f"{kind} {ref['name']}/{ref['key']} not found in namespace {namespace}")
                if plural == "secrets":
                    return base64.b64decode(data[ref["key"]]).decode()
                return str(data[ref["key"]])
        raise ValueError(f"env valueFrom {sorted(source)} is not supported")

    async def _supervise(
        self,
        runtime: PodRuntime,
        argv: list[str],
        env: dict[str, str],
        container: Mapping[str, Any],
        run_to_completion: bool,
    ) -> None:
        restarts = 0
        while not runtime.stopping:
            with runtime.log_path.open("ab") as log:
                runtime.process = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                )
            _live_process_groups.add(runtime.process.pid)
            probe = None if run_to_completion else asyncio.create_task(self._probe(runtime, container, restarts))
            try:
                exit_code = await runtime.process.wait()
            finally:
                _live_process_groups.discard(runtime.process.pid)
            if probe is not None:
                probe.cancel()
            if runtime.stopping:
                return
            message = self._termination_message(runtime, container, exit_code)
            if exit_code != 0:  # in the test's captured log, where a failure's cause is otherwise out of sight
                logger.warning("dev cluster pod %s/%s exited with %d; log tail:\n%s", runtime.namespace,
                               runtime.name, exit_code, self._log_tail(runtime, LOG_TAIL_ON_FAILURE))  # fmt: skip
            terminated = {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "finishedAt": now_timestamp(),
                "message": message,
            }
            if run_to_completion:
                state = self._container_status(container, False, {"terminated": terminated}, restarts)
                phase = "Succeeded" if exit_code == 0 else "Failed"
                self._update_pod_status(runtime, state, "PodCompleted", phase)
                return
            restarts += 1
            waiting = {"waiting": {"reason": "CrashLoopBackOff", "message": f"container exited with {exit_code}"}}
            state = {
                **self._container_status(container, False, waiting, restarts),
                "lastState": {"terminated": terminated},
            }
            self._update_pod_status(runtime, state, "ContainersNotReady")
            await asyncio.sleep(min(5.0, self.restart_backoff_seconds * 2 ** min(restarts, 5)))

    def _termination_message(self, runtime: PodRuntime, container: Mapping[str, Any], exit_code: int) -> str:
        if runtime.termination_log.exists():
            message = runtime.termination_log.read_bytes()[:TERMINATION_LOG_LIMIT].decode(errors="replace")
            if message:
                return message
        if exit_code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            return self._log_tail(runtime, TERMINATION_LOG_LIMIT)
        return ""

    @staticmethod
    def _log_tail(runtime: PodRuntime, limit: int) -> str:
        if not runtime.log_path.exists():
            return ""
        with runtime.log_path.open("rb") as log:
            log.seek(max(0, runtime.log_path.stat().st_size - limit))
            return log.read().decode(errors="replace")

    async def _probe(self, runtime: PodRuntime, container: Mapping[str, Any], restarts: int) -> None:
        """Mark the pod ready once its process answers GET /health with 200."""
        assert self._http is not None
        url = f"http://{runtime.ip}:{container_port(container)}/health"
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self._http.get(url) as response:
                    if response.status == 200:
                        break
            await asyncio.sleep(HEALTH_POLL_SECONDS)
        running = {"running": {"startedAt": now_timestamp()}}
        self._update_pod_status(runtime, self._container_status(container, True, running, restarts), "")

    def _update_pod_status(
        self, runtime: PodRuntime, container_status: dict[str, Any], not_ready_reason: str, phase: str | None = None
    ) -> None:
        """Record the container's new state; the pod is ready exactly when the container is."""
        pod = self.store.find(self._pods, runtime.namespace, runtime.name)
        if pod is None or pod["metadata"]["uid"] != runtime.uid:
            return
        status = copy.deepcopy(pod.get("status") or {})
        ready = container_status["ready"]
        status["containerStatuses"] = [container_status]
        status["conditions"] = with_condition(
            status.get("conditions") or [], "Ready", "True" if ready else "False", "" if ready else not_ready_reason
        )
        if phase is not None:
            status["phase"] = phase
        self._write_status(pod, status)

    def _stop_later(self, runtime: PodRuntime) -> None:
        task = asyncio.create_task(self._stop(runtime))
        self._stopping_tasks.add(task)
        task.add_done_callback(self._stopping_tasks.discard)

    @staticmethod
    async def _stop(runtime: PodRuntime) -> None:
        """Terminate the pod's whole process group: SIGTERM, then SIGKILL after a grace period."""
        runtime.stopping = True
        process = runtime.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(STOP_GRACE_SECONDS):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if runtime.task is not None:
            runtime.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runtime.task
