"""A stand-in for KServe's LLMInferenceService controller (kserve/kserve, pkg/controller/v1alpha2/llmisvc), which
cannot run here, and the upstream CRD it serves (KServe v0.20.0's minimal CRD without descriptions, in
`upstream_crds/`). It follows KServe's own code and presets (kserve/kserve at aaac4e29, 2026-08-21):

- Workloads (workload_single_node.go, workload_multi_node.go): the Deployment `<name>-kserve`, or with `spec.worker`
  the LeaderWorkerSet `<name>-kserve-mn` (leader: `spec.template`, workers: `spec.worker`, size from
  `spec.parallelism`: data / dataLocal, else pipeline); with `spec.prefill` the Deployment `<name>-kserve-prefill`, or
  with `spec.prefill.worker` the LeaderWorkerSet `<name>-kserve-mn-prefill`. KServe's labels on each (component
  `llminferenceservice-workload[-leader|-worker|-prefill...]`, `kserve.io/component: workload`, `llm-d.ai/role`) and
  `spec.labels`. Each `main` container runs as the presets run it (config-llm-template, -worker-data-parallel,
  -prefill-template): `vllm serve MODEL --served-model-name NAME --port 8000 [--tensor-parallel-size T] [--headless]
  ${VLLM_ADDITIONAL_ARGS} ARGS`, its own env's VLLM_ADDITIONAL_ARGS (the dev cluster's LeaderWorkerSet stand-in runs
  the multi-node ones). `serving.kserve.io/stop: "true"` takes every workload to zero, and removes the route, the
  workload Service and the pool.
- The workload Service `<name>-kserve-workload-svc` (port 8000, KServe's workload selector).
- With `spec.router.scheduler` (and no `pool.ref`): the InferencePool `<name>-inference-pool`, from
  `scheduler.pool.spec` or the config-llm-scheduler preset's (selector on the workload labels, target port 8000, the
  EPP Service `<name>-epp-service`:9002, FailOpen). The EPP itself is not made.
- With `spec.router.route` (and no `http.refs`): the HTTPRoute `<name>-kserve-route` from `route.http.spec` or the
  config-llm-router-route preset's rules (a subset: the per-service paths, the publisher paths, the catch-all), with
  the routing group's weights written as KServe's router_group_routing.go writes them: every rule that is not
  per-service and has a controller-made backend gets one backendRef per member of the group, weighted by the
  member's `spec.router.route.weight` (unset: 0); stopped members are left out; members are the group's services that
  are not being deleted and are ready, stopped, or the service itself (router_group.go filterEligibleMembers). A
  member's backend is its InferencePool, else its workload Service. The route and pool are created through the API
  server, so the upstream HTTPRoute and InferencePool schemas and CEL rules admit them (the Gateway API CRDs must be
  installed: without the HTTPRoute CRD KServe marks GatewayPreconditionNotMet and routes nothing, and so does this).
- Status: Ready once every workload is; `status.router.group` {name, members[{name, weight, stopped, backendRef}]}
  written after the route, as applyGroupStatus does.

Not modelled: the EPP Deployment, Gateways and their status, storage initialisers, scaling, LoRA, model-name
divergence (GroupDegraded), the InferencePool v1alpha2 migration.
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

GROUP, VERSION, PLURAL, KIND = "serving.kserve.io", "v1alpha2", "llminferenceservices", "LLMInferenceService"
CRD_FILE = "serving.kserve.io_llminferenceservices.json"
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
KSERVE_COMPONENT_LABEL = "kserve.io/component"
ROLE_LABEL = "llm-d.ai/role"
ROUTING_GROUP_LABEL = "serving.kserve.io/routing-group"
STOP_ANNOTATION = "serving.kserve.io/stop"
ADDITIONAL_ARGS = "VLLM_ADDITIONAL_ARGS"
INFERENCE_GROUP = "inference.networking.k8s.io"
PORT = 8000
# The gateway KServe's configuration names (config-llm-router-route's parentRefs, from inferenceservice-config).
GATEWAY, GATEWAY_NAMESPACE = "kserve-ingress-gateway", "kserve"
# The stand-in's own mark of what it last wrote into an object (the API server defaults the rest).
SPEC_HASH_ANNOTATION = "kvpolicy.dev/kserve-standin-spec"


def crd() -> Obj:
    """The upstream LLMInferenceService CRD, to install into the dev cluster."""
    return upstream_crd(CRD_FILE)


def workload_labels(name: str, component: str = "llminferenceservice-workload") -> dict[str, str]:
    return {COMPONENT_LABEL: component, NAME_LABEL: name, PART_OF_LABEL: "llminferenceservice"}


def workload_selector(name: str) -> dict[str, str]:
    """GetWorkloadLabelSelector: the workload Service's selector, and the scheduler preset pool's."""
    return {PART_OF_LABEL: "llminferenceservice", NAME_LABEL: name, KSERVE_COMPONENT_LABEL: "workload"}


def route_name(name: str) -> str:
    return f"{name}-kserve-route"


def service_name(name: str) -> str:
    return f"{name}-kserve-workload-svc"


def pool_name(name: str) -> str:
    return f"{name}-inference-pool"


def _stopped(isvc: Mapping[str, Any]) -> bool:
    return (isvc["metadata"].get("annotations") or {}).get(STOP_ANNOTATION) == "true"


def _router(isvc: Mapping[str, Any]) -> Mapping[str, Any]:
    return (isvc.get("spec") or {}).get("router") or {}


def _route(isvc: Mapping[str, Any]) -> Mapping[str, Any]:
    return _router(isvc).get("route") or {}


def _scheduled(isvc: Mapping[str, Any]) -> bool:
    """A scheduler whose pool KServe makes (a `pool.ref` names the user's own)."""
    scheduler = _router(isvc).get("scheduler")
    return scheduler is not None and not ((scheduler.get("pool") or {}).get("ref"))


def _model(isvc: Mapping[str, Any]) -> str:
    return str(((isvc.get("spec") or {}).get("model") or {}).get("name") or isvc["metadata"]["name"])


def main_container(isvc: Mapping[str, Any], pod: Mapping[str, Any] | None = None, *, worker: bool = False,
                   parallelism: Mapping[str, Any] | None = None) -> Obj:  # fmt: skip
    """The preset's `main` container with the pod spec's merged in, running `vllm serve` as the preset does."""
    spec = isvc.get("spec") or {}
    given_pod: Mapping[str, Any] = (spec.get("template") or {}) if pod is None else pod
    containers = given_pod.get("containers") or []
    given = copy.deepcopy(next((c for c in containers if c.get("name") == "main"), containers[0] if containers else {}))
    env = given.get("env") or []
    additional = next((str(e.get("value") or "") for e in env if e.get("name") == ADDITIONAL_ARGS), "")
    model = _model(isvc)
    sizes: Mapping[str, Any] = (spec.get("parallelism") or {}) if parallelism is None else parallelism
    tensor = sizes.get("tensor")
    args = [model, "--served-model-name", model, "--port", str(PORT)]
    args += [
        *(["--tensor-parallel-size", str(tensor)] if tensor else []),
        *(["--headless"] if worker else []),
        *additional.split(),
        *(given.get("args") or []),
    ]
    return {
        **given,
        "name": "main",
        "image": given.get("image") or "ghcr.io/llm-d/llm-d-cuda:v0.9.0",
        "command": ["vllm", "serve"],
        "args": args,
        "ports": [{"containerPort": PORT, "protocol": "TCP"}],
    }


def _pod_spec(isvc: Obj, pod: Mapping[str, Any] | None, worker: bool, parallelism: Mapping[str, Any] | None) -> Obj:
    merged = copy.deepcopy(dict(pod or {}))
    given = merged.get("containers") or []
    others = [c for c in given if c.get("name") != "main"]
    if not any(c.get("name") == "main" for c in given):
        others = others[1:]
    merged["containers"] = [main_container(isvc, pod or {}, worker=worker, parallelism=parallelism), *others]
    return merged


def _group_size(parallelism: Mapping[str, Any]) -> int:
    """ParallelismSpec.GetSize: data / dataLocal for data parallelism, else pipeline."""
    if parallelism.get("data") or parallelism.get("dataLocal"):
        return max(int(parallelism.get("data") or 1) // int(parallelism.get("dataLocal") or 1), 1)
    return int(parallelism.get("pipeline") or 1)


class LLMInferenceServiceController:
    """Reconciles every LLMInferenceService in the store once the CRD is installed (the kubelet calls it each pass)."""

    def reconcile(self, store: Store) -> None:
        try:
            services = store.find_type(GROUP, VERSION, PLURAL)
        except ApiError:  # the CRD is not installed
            return
        live = [isvc for isvc in store.list_objects(services) if not isvc["metadata"].get("deletionTimestamp")]
        for isvc in live:
            ready = all([self._workload(store, isvc, prefill=False), self._workload(store, isvc, prefill=True)])
            self._workload_service(store, isvc)
            self._pool(store, isvc)
            members = self._route(store, isvc, live)
            self._write_status(store, services, isvc, ready, members)

    # ----------------------------------------------------------------------------------------------- writing

    @staticmethod
    def _apply(store: Store, rt: ResourceType, isvc: Obj, name: str, labels: dict[str, str], spec: Obj) -> Obj:
        """Create or replace the object `name` KServe owns, when what the stand-in wants of it changed."""
        meta = isvc["metadata"]
        owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
                 "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        digest = hashlib.sha256(json.dumps([labels, spec], sort_keys=True).encode()).hexdigest()[:16]
        metadata = {"name": name, "labels": labels, "annotations": {SPEC_HASH_ANNOTATION: digest},
                    "ownerReferences": [owner]}  # fmt: skip
        current = store.find(rt, meta["namespace"], name)
        if current is None:
            return store.create(rt, meta["namespace"], {"metadata": metadata, "spec": spec})
        if (current["metadata"].get("annotations") or {}).get(SPEC_HASH_ANNOTATION) != digest:
            body = {**current, "metadata": {**current["metadata"], **metadata}, "spec": spec}
            return store.replace(rt, meta["namespace"], name, body)
        return current

    @staticmethod
    def _remove(store: Store, rt: ResourceType, namespace: str, name: str) -> None:
        if store.find(rt, namespace, name) is not None:
            store.delete(rt, namespace, name)

    def _workload(self, store: Store, isvc: Obj, *, prefill: bool) -> bool:
        """The primary (or prefill) workload: a Deployment, or a LeaderWorkerSet where it has workers; True once
        ready (a workload the spec does not ask for is ready)."""
        meta, spec = isvc["metadata"], isvc.get("spec") or {}
        name, namespace = meta["name"], meta["namespace"]
        source = spec.get("prefill") if prefill else spec
        deployment_name = f"{name}-kserve-prefill" if prefill else f"{name}-kserve"
        lws_name = f"{name}-kserve-mn-prefill" if prefill else f"{name}-kserve-mn"
        deployments = store.find_type("apps", "v1", "deployments")
        if source is None:
            self._remove(store, deployments, namespace, deployment_name)
            return True
        suffix = "-prefill" if prefill else ""
        role = "prefill" if prefill else ("decode" if spec.get("prefill") is not None else "both")
        replicas = 0 if _stopped(isvc) else int(source.get("replicas", 1))
        parallelism = source.get("parallelism") or {}
        own = {**(spec.get("labels") or {})}
        if "worker" not in source:
            labels = {**workload_labels(name, f"llminferenceservice-workload{suffix}"),
                      KSERVE_COMPONENT_LABEL: "workload", ROLE_LABEL: role}  # fmt: skip
            template = _pod_spec(isvc, source.get("template"), False, parallelism)
            body = {"replicas": replicas, "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": {**own, **labels}}, "spec": template}}  # fmt: skip
            current = self._apply(store, deployments, isvc, deployment_name, labels, body)
            return replicas > 0 and int((current.get("status") or {}).get("readyReplicas") or 0) >= replicas
        try:
            sets = store.find_type("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
        except ApiError:  # KServe needs the LeaderWorkerSet CRD for multi-node services
            return False
        leader = {**workload_labels(name, f"llminferenceservice-workload-leader{suffix}"),
                  KSERVE_COMPONENT_LABEL: "workload", ROLE_LABEL: role}  # fmt: skip
        worker = workload_labels(name, f"llminferenceservice-workload-worker{suffix}")
        body = {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": _group_size(parallelism),
                "leaderTemplate": {"metadata": {"labels": {**own, **leader}},
                                   "spec": _pod_spec(isvc, source.get("template"), False, parallelism)},
                "workerTemplate": {"metadata": {"labels": {**own, **worker}},
                                   "spec": _pod_spec(isvc, source.get("worker"), True, parallelism)},
            },
        }  # fmt: skip
        current = self._apply(store, sets, isvc, lws_name, worker, body)
        return replicas > 0 and int((current.get("status") or {}).get("readyReplicas") or 0) >= replicas

    def _workload_service(self, store: Store, isvc: Obj) -> None:
        services = store.find_type("", "v1", "services")
        name, namespace = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
        if _stopped(isvc):
            self._remove(store, services, namespace, service_name(name))
            return
        port = {"name": "http", "protocol": "TCP", "appProtocol": "http", "port": PORT, "targetPort": PORT}
        body = {"selector": workload_selector(name), "ports": [port], "type": "ClusterIP"}
        self._apply(store, services, isvc, service_name(name), workload_labels(name), body)

    def _pool(self, store: Store, isvc: Obj) -> None:
        try:
            pools = store.find_type(INFERENCE_GROUP, "v1", "inferencepools")
        except ApiError:  # no InferencePool CRD: KServe skips the pool
            return
        name, namespace = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
        if _stopped(isvc) or not _scheduled(isvc):
            self._remove(store, pools, namespace, pool_name(name))
            return
        given = ((_router(isvc).get("scheduler") or {}).get("pool") or {}).get("spec")
        preset = {
            "selector": {"matchLabels": workload_selector(name)},
            "targetPorts": [{"number": PORT}],
            "endpointPickerRef": {"kind": "Service", "name": f"{name}-epp-service", "port": {"number": 9002},
                                  "failureMode": "FailOpen"},
        }  # fmt: skip
        labels = workload_labels(name, "llminferenceservice-router-scheduler")
        self._apply(store, pools, isvc, pool_name(name), labels, copy.deepcopy(given) if given else preset)

    # ------------------------------------------------------------------------------------------------ routing

    @staticmethod
    def _backend(isvc: Mapping[str, Any]) -> Obj:
        """resolveMemberBackendRef: the member's InferencePool when it has a scheduler, else its workload Service."""
        name = isvc["metadata"]["name"]
        if _scheduled(isvc):
            return {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": pool_name(name), "port": PORT}
        return {"kind": "Service", "name": service_name(name), "port": PORT}

    @staticmethod
    def _preset_route(isvc: Mapping[str, Any], backend: Obj) -> Obj:
        """config-llm-router-route's rules (a subset), rendered for the service."""
        name, namespace, model = isvc["metadata"]["name"], isvc["metadata"]["namespace"], _model(isvc)
        own = {**backend, "weight": 1}
        service = {"kind": "Service", "name": service_name(name), "port": PORT, "weight": 1}
        timeouts = {"backendRequest": "0s", "request": "0s"}

        def rule(rule_name: str, prefix: str, replace: str, ref: Obj) -> Obj:
            path = {"type": "ReplacePrefixMatch", "replacePrefixMatch": replace}
            rewrite = {"type": "URLRewrite", "urlRewrite": {"path": path}}
            return {"name": rule_name, "backendRefs": [dict(ref)],
                    "matches": [{"path": {"type": "PathPrefix", "value": prefix}}], "filters": [rewrite],
                    "timeouts": timeouts}  # fmt: skip

        publisher = f"/publishers/{namespace}/models/{model}"
        return {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": GATEWAY,
                            "namespace": GATEWAY_NAMESPACE}],
            "rules": [
                rule("v1-completions-path", f"/{namespace}/{name}/v1/completions", "/v1/completions", own),
                rule("v1-chat-completions-path", f"/{namespace}/{name}/v1/chat/completions", "/v1/chat/completions",
                     own),
                rule("v1-completions-publisher-path", f"{publisher}/v1/completions", "/v1/completions", own),
                rule("v1-chat-completions-publisher-path", f"{publisher}/v1/chat/completions", "/v1/chat/completions",
                     own),
                rule("v1-catch-all-path", f"/{namespace}/{name}", "/", service),
            ],
        }  # fmt: skip

    @staticmethod
    def _members(isvc: Obj, live: list[Obj]) -> list[Obj]:
        """filterEligibleMembers + resolveGroupMembers: the group's members, sorted by name."""
        group, namespace, me = _route(isvc).get("group"), isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        members = []
        for other in live:
            meta = other["metadata"]
            if meta["namespace"] != namespace or _route(other).get("group") != group:
                continue
            conditions = (other.get("status") or {}).get("conditions") or []
            routable = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
            if meta["name"] != me and not _stopped(other) and not routable:
                continue
            member = {"name": meta["name"], "weight": int(_route(other).get("weight") or 0),
                      "backendRef": LLMInferenceServiceController._backend(other)}  # fmt: skip
            if _stopped(other):
                member["stopped"] = True
            members.append(member)
        return sorted(members, key=lambda m: m["name"])

    def _route(self, store: Store, isvc: Obj, live: list[Obj]) -> list[Obj] | None:
        """The service's HTTPRoute; the group's members it was written with (None: no group, or no route)."""
        try:
            routes = store.find_type("gateway.networking.k8s.io", "v1", "httproutes")
        except ApiError:  # KServe: GatewayPreconditionNotMet, nothing routed
            return None
        meta = isvc["metadata"]
        route = _route(isvc)
        http = route.get("http") or {}
        if _stopped(isvc) or "route" not in _router(isvc) or http.get("refs"):
            self._remove(store, routes, meta["namespace"], route_name(meta["name"]))
            return None
        backend = self._backend(isvc)
        spec = copy.deepcopy(http["spec"]) if http.get("spec") else self._preset_route(isvc, backend)
        labels = workload_labels(meta["name"], "llminferenceservice-router")
        members = None
        if route.get("group") is not None:
            labels[ROUTING_GROUP_LABEL] = str(route["group"])
            members = self._members(isvc, live)
            weighted = [{**m["backendRef"], "weight": m["weight"]} for m in members if not m.get("stopped")]
            per_service = f"/{meta['namespace']}/{meta['name']}"
            for rule in spec.get("rules") or []:
                paths = [str((m.get("path") or {}).get("value") or "") for m in rule.get("matches") or []]
                if any(p == per_service or p.startswith(per_service + "/") for p in paths):
                    continue  # rewriteRulesForGroup: a per-service rule keeps its own backend
                ours = {(backend.get("kind"), backend["name"]), ("Service", service_name(meta["name"]))}
                if any((ref.get("kind", "Service"), ref.get("name")) in ours for ref in rule.get("backendRefs") or []):
                    rule["backendRefs"] = copy.deepcopy(weighted)
        self._apply(store, routes, isvc, route_name(meta["name"]), labels, spec)
        return members

    @staticmethod
    def _write_status(store: Store, services: Any, isvc: Obj, ready_workloads: bool, members: list[Obj] | None) -> None:
        ready = "True" if ready_workloads and not _stopped(isvc) else "False"
        previous = {c.get("type"): c for c in (isvc.get("status") or {}).get("conditions") or []}
        before = previous.get("Ready") or {}
        since = before.get("lastTransitionTime") if before.get("status") == ready else None
        status: Obj = {
            "observedGeneration": isvc["metadata"].get("generation", 1),
            "conditions": [
                {
                    "type": "Ready",
                    "status": ready,
                    "lastTransitionTime": since or now_timestamp(),
                    "reason": "WorkloadReady" if ready == "True" else "WorkloadNotReady",
                }
            ],
        }
        if members is not None:  # applyGroupStatus, after the route write
            status["router"] = {"group": {"name": _route(isvc)["group"], "members": members}}
        if isvc.get("status") != status:
            meta = isvc["metadata"]
            store.replace(services, meta["namespace"], meta["name"], {**isvc, "status": status}, "status")
