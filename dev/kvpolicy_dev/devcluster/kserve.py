"""A stand-in for KServe's LLMInferenceService controller (kserve/kserve, pkg/controller/v1alpha2/llmisvc), which
cannot run here, and the upstream CRD it serves (`crds/`, KServe v0.20.0's minimal CRD without descriptions).

For each LLMInferenceService it keeps the Deployment `<name>-kserve` that KServe's single-node workload is, with
KServe's workload labels and `spec.labels` on its pods, and `spec.template`'s `main` container run as KServe's preset
(config-llm-template) runs it: `vllm serve MODEL --served-model-name NAME --port 8000 [--tensor-parallel-size
spec.parallelism.tensor] ${VLLM_ADDITIONAL_ARGS} ARGS`. `serving.kserve.io/stop: "true"` takes it to zero pods. Its
status says Ready once the pods are, and `status.router.group` lists the members of its routing group
(`spec.router.route.group`) with their weights, as KServe's does. Not modelled: the HTTPRoute, InferencePool and
scheduler KServe makes (no Gateway API here: traffic weights are read back, not enforced), multi-node and
prefill/decode workloads, storage initialisers, scaling.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvpolicy_dev.devcluster.store import ApiError, Obj, Store, now_timestamp
from kvpolicy_dev.devcluster.upstream import upstream_crd

GROUP, VERSION, PLURAL, KIND = "serving.kserve.io", "v1alpha2", "llminferenceservices", "LLMInferenceService"
CRD_FILE = "serving.kserve.io_llminferenceservices.json"
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
STOP_ANNOTATION = "serving.kserve.io/stop"
ADDITIONAL_ARGS = "VLLM_ADDITIONAL_ARGS"
# The stand-in's own mark of what it last wrote into the workload Deployment (the API server defaults the rest).
SPEC_HASH_ANNOTATION = "kvpolicy.dev/kserve-standin-spec"


def crd() -> Obj:
    """The upstream LLMInferenceService CRD, to install into the dev cluster."""
    return upstream_crd(CRD_FILE)


def workload_labels(name: str) -> dict[str, str]:
    return {COMPONENT_LABEL: "llminferenceservice-workload", NAME_LABEL: name, PART_OF_LABEL: "llminferenceservice"}


def _stopped(isvc: Mapping[str, Any]) -> bool:
    return (isvc["metadata"].get("annotations") or {}).get(STOP_ANNOTATION) == "true"


def _route(isvc: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((isvc.get("spec") or {}).get("router") or {}).get("route") or {}


def main_container(isvc: Mapping[str, Any]) -> Obj:
    """The preset's `main` container with the template's merged in, running `vllm serve` as the preset does."""
    spec = isvc.get("spec") or {}
    containers = (spec.get("template") or {}).get("containers") or []
    given = copy.deepcopy(next((c for c in containers if c.get("name") == "main"), containers[0] if containers else {}))
    env = given.get("env") or []
    additional = next((str(e.get("value") or "") for e in env if e.get("name") == ADDITIONAL_ARGS), "")
    model = str((spec.get("model") or {}).get("name") or isvc["metadata"]["name"])
    tensor = (spec.get("parallelism") or {}).get("tensor")
    args = [model, "--served-model-name", model, "--port", "8000"]
    args += [
        *(["--tensor-parallel-size", str(tensor)] if tensor else []),
        *additional.split(),
        *(given.get("args") or []),
    ]
    return {
        **given,
        "name": "main",
        "image": given.get("image") or "ghcr.io/llm-d/llm-d-cuda:v0.9.0",
        "command": ["vllm", "serve"],
        "args": args,
        "ports": [{"containerPort": 8000, "protocol": "TCP"}],
    }


class LLMInferenceServiceController:
    """Reconciles every LLMInferenceService in the store once the CRD is installed (the kubelet calls it each pass)."""

    def reconcile(self, store: Store) -> None:
        try:
            services = store.find_type(GROUP, VERSION, PLURAL)
        except ApiError:  # the CRD is not installed
            return
        deployments = store.find_type("apps", "v1", "deployments")
        live = [isvc for isvc in store.list_objects(services) if not isvc["metadata"].get("deletionTimestamp")]
        for isvc in live:
            deployment = self._workload(store, deployments, isvc)
            self._write_status(store, services, isvc, deployment, live)

    @staticmethod
    def _workload(store: Store, deployments: Any, isvc: Obj) -> Obj:
        meta, spec = isvc["metadata"], isvc.get("spec") or {}
        name, namespace = f"{meta['name']}-kserve", meta["namespace"]
        labels = workload_labels(meta["name"])
        template = copy.deepcopy(spec.get("template") or {})
        main = main_container(isvc)
        others = [c for c in template.get("containers") or [] if c.get("name") != "main"]
        template["containers"] = [
            main,
            *(others if any(c.get("name") == "main" for c in template.get("containers") or []) else others[1:]),
        ]
        owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
                 "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        desired = {
            "replicas": 0 if _stopped(isvc) else int(spec.get("replicas", 1)),
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": {**(spec.get("labels") or {}), **labels}}, "spec": template},
        }
        digest = hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()[:16]
        body = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": name,
                "labels": labels,
                "annotations": {SPEC_HASH_ANNOTATION: digest},
                "ownerReferences": [owner],
            },
            "spec": desired,
        }
        current = store.find(deployments, namespace, name)
        if current is None:
            return store.create(deployments, namespace, body)
        if (current["metadata"].get("annotations") or {}).get(SPEC_HASH_ANNOTATION) != digest:
            metadata = {**current["metadata"], "annotations": {SPEC_HASH_ANNOTATION: digest}}
            return store.replace(deployments, namespace, name, {**current, "metadata": metadata, "spec": desired})
        return current

    @staticmethod
    def _write_status(store: Store, services: Any, isvc: Obj, deployment: Obj, live: list[Obj]) -> None:
        replicas = deployment["spec"].get("replicas", 1)
        observed = deployment.get("status") or {}
        ready = "True" if (observed.get("readyReplicas") or 0) >= replicas and replicas > 0 else "False"
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
        group = _route(isvc).get("group")
        if group is not None:
            members = [
                {
                    "name": other["metadata"]["name"],
                    "weight": int(_route(other).get("weight", 1)),
                    **({"stopped": True} if _stopped(other) else {}),
                }
                for other in live
                if other["metadata"]["namespace"] == isvc["metadata"]["namespace"]
                and _route(other).get("group") == group
            ]
            status["router"] = {"group": {"name": group, "members": sorted(members, key=lambda m: m["name"])}}
        if isvc.get("status") != status:
            meta = isvc["metadata"]
            store.replace(services, meta["namespace"], meta["name"], {**isvc, "status": status}, "status")
