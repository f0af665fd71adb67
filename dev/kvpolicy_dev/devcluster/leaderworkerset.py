"""A stand-in for the LeaderWorkerSet controller (kubernetes-sigs/lws), which cannot run here, and the upstream CRD it
serves (`crds/`, LWS v0.9.0's schema without its descriptions).

For each group `g` of a LeaderWorkerSet it makes the leader pod `<name>-<g>` from the leader template (the worker
template when there is none) and the workers `<name>-<g>-<i>`, i = 1..size-1, from the worker template, with the
labels, annotations and env the real controller gives them (api/leaderworkerset/v1: set name, group index, worker
index, template revision; LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX). A group whose templates changed is
recreated whole, one group at a time (RollingUpdate with maxUnavailable 1, maxSurge 0); groups beyond `replicas` go.
The status counts groups as the real one does (replicas, updatedReplicas, readyReplicas: every pod of the group
ready). Not modelled: the per-group StatefulSets the real controller makes, startupPolicy, subgroups, exclusive
topology, surge groups and partitions.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvpolicy_dev.devcluster.resources import ResourceType
from kvpolicy_dev.devcluster.store import ApiError, Obj, Store, now_timestamp
from kvpolicy_dev.devcluster.upstream import upstream_crd

GROUP, VERSION, PLURAL, KIND = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet"
CRD_FILE = "leaderworkerset.x-k8s.io_leaderworkersets.json"
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"


def crd() -> Obj:
    """The upstream LeaderWorkerSet CRD, to install into the dev cluster."""
    return upstream_crd(CRD_FILE)


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _revision(spec: Mapping[str, Any]) -> str:
    templates = spec.get("leaderWorkerTemplate") or {}
    text = json.dumps({key: templates.get(key) for key in ("leaderTemplate", "workerTemplate", "size")}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


class LeaderWorkerSetController:
    """Reconciles every LeaderWorkerSet in the store once the CRD is installed (the kubelet calls it each pass)."""

    def reconcile(self, store: Store) -> None:
        try:
            sets = store.find_type(GROUP, VERSION, PLURAL)
        except ApiError:  # the CRD is not installed
            return
        pods = store.find_type("", "v1", "pods")
        for lws in store.list_objects(sets):
            if not lws["metadata"].get("deletionTimestamp"):
                self._reconcile(store, pods, lws)

    def _reconcile(self, store: Store, pods_type: ResourceType, lws: Obj) -> None:
        meta, spec = lws["metadata"], lws.get("spec") or {}
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        replicas = int(spec.get("replicas", 1))
        templates = spec.get("leaderWorkerTemplate") or {}
        size = int(templates.get("size", 1))
        revision = _revision(spec)
        owned = [
            pod
            for pod in store.list_objects(pods_type, namespace)
            if any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or [])
        ]
        groups: dict[int, list[Obj]] = {}
        for pod in owned:
            groups.setdefault(int(pod["metadata"]["labels"].get(GROUP_INDEX_LABEL, "0")), []).append(pod)
        for group, members in groups.items():
            if group >= replicas:
                for pod in members:
                    self._delete(store, pods_type, pod)
        # One group at a time is recreated on a template change, and only while every other group is whole.
        stale = sorted(g for g, members in groups.items() if g < replicas and self._stale(members, revision))
        if stale and all(len(groups.get(g, [])) == size for g in range(replicas) if g != stale[0]):
            for pod in groups[stale[0]]:
                self._delete(store, pods_type, pod)
            groups[stale[0]] = []
        for group in range(replicas):
            existing = {pod["metadata"]["name"] for pod in groups.get(group, [])}
            for index in range(size):
                pod_name = f"{name}-{group}" if index == 0 else f"{name}-{group}-{index}"
                if pod_name not in existing and store.find(pods_type, namespace, pod_name) is None:
                    store.create(pods_type, namespace, self._pod(lws, group, index, size, revision))
        self._write_status(store, lws, replicas, size, revision)

    @staticmethod
    def _stale(members: list[Obj], revision: str) -> bool:
        return any(pod["metadata"]["labels"].get(REVISION_LABEL) != revision for pod in members)

    @staticmethod
    def _delete(store: Store, pods_type: ResourceType, pod: Obj) -> None:
        try:
            store.delete(pods_type, pod["metadata"]["namespace"], pod["metadata"]["name"])
        except ApiError:  # gone already
            return

    @staticmethod
    def _pod(lws: Obj, group: int, index: int, size: int, revision: str) -> Obj:
        meta = lws["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        templates = lws["spec"]["leaderWorkerTemplate"]
        template = templates.get("leaderTemplate") if index == 0 else None
        template = copy.deepcopy(template or templates["workerTemplate"])
        leader = f"{name}-{group}"
        labels = {
            **((template.get("metadata") or {}).get("labels") or {}),
            SET_NAME_LABEL: name,
            GROUP_INDEX_LABEL: str(group),
            WORKER_INDEX_LABEL: str(index),
            GROUP_KEY_LABEL: hashlib.sha1(f"{namespace}/{leader}".encode()).hexdigest(),
            REVISION_LABEL: revision,
        }
        annotations = {**((template.get("metadata") or {}).get("annotations") or {}), SIZE_ANNOTATION: str(size)}
        if index:
            annotations[LEADER_NAME_ANNOTATION] = leader
        pod_spec = template.get("spec") or {}
        env = [
            {"name": "LWS_LEADER_ADDRESS", "value": f"{leader}.{name}.{namespace}"},
            {"name": "LWS_GROUP_SIZE", "value": str(size)},
            {"name": "LWS_WORKER_INDEX", "value": str(index)},
        ]
        for container in pod_spec.get("containers") or []:
            container["env"] = [*(container.get("env") or []), *env]
        owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": meta["uid"],
                 "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": leader if index == 0 else f"{leader}-{index}",
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [owner],
            },
            "spec": pod_spec,
        }

    @staticmethod
    def _write_status(store: Store, lws: Obj, replicas: int, size: int, revision: str) -> None:
        pods_type = store.find_type("", "v1", "pods")
        uid = lws["metadata"]["uid"]
        pods = [
            pod
            for pod in store.list_objects(pods_type, lws["metadata"]["namespace"])
            if any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or [])
            and not pod["metadata"].get("deletionTimestamp")
        ]
        groups: dict[str, list[Obj]] = {}
        for pod in pods:
            groups.setdefault(pod["metadata"]["labels"][GROUP_INDEX_LABEL], []).append(pod)
        updated = [g for g, members in groups.items() if not LeaderWorkerSetController._stale(members, revision)]
        ready = [g for g, members in groups.items() if len(members) == size and all(map(_ready, members))]
        available = "True" if len(ready) >= replicas else "False"
        conditions = (lws.get("status") or {}).get("conditions") or []
        before: Mapping[str, Any] = next((c for c in conditions if c.get("type") == "Available"), {})
        since = before.get("lastTransitionTime") if before.get("status") == available else now_timestamp()
        status = {
            "replicas": len(groups),
            "updatedReplicas": len(updated),
            "readyReplicas": len(ready),
            "observedGeneration": lws["metadata"].get("generation", 1),
            "hpaPodSelector": f"{SET_NAME_LABEL}={lws['metadata']['name']},{WORKER_INDEX_LABEL}=0",
            "conditions": [
                {
                    "type": "Available",
                    "status": available,
                    "reason": "AllGroupsReady" if available == "True" else "GroupsNotReady",
                    "message": f"{len(ready)} of {replicas} groups ready",
                    "lastTransitionTime": since,
                }
            ],
        }
        if lws.get("status") != status:
            rt = store.find_type(GROUP, VERSION, PLURAL)
            store.replace(
                rt, lws["metadata"]["namespace"], lws["metadata"]["name"], {**lws, "status": status}, "status"
            )
