"""Node pools, pod IPs, scheduling and Service URL rewriting for the kubelet stand-in (pure functions)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpolicy_dev.devcluster.runners import GPU_PRODUCT_LABEL, GPU_RESOURCE, gpu_model
from kvpolicy_dev.devcluster.selectors import match_labels

POOL_LABEL = "kvpolicy.dev/node-pool"
CPU_POOL = "cpu"
Obj = dict[str, Any]


@dataclass
class NodePool:
    """Nodes of one GPU model; `capacity_pods` caps how many GPU pods fit in the pool (None: no cap)."""

    name: str
    gpu_product: str | None = "NVIDIA-H100-80GB-HBM3"  # None: a CPU-only pool
    nodes: int = 1
    gpus_per_node: int = 8
    capacity_pods: int | None = None

    def node_names(self) -> list[str]:
        return [f"{self.name}-{index}" for index in range(self.nodes)]

    def labels(self) -> dict[str, str]:
        labels = {POOL_LABEL: self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
        if self.gpu_product is not None:
            model = gpu_model(self.gpu_product)
            labels |= {
                GPU_PRODUCT_LABEL: self.gpu_product,
                "nvidia.com/gpu.family": model.family,
                "nvidia.com/gpu.compute.major": str(model.compute_major),
                "nvidia.com/gpu.compute.minor": str(model.compute_minor),
                "nvidia.com/gpu.count": str(self.gpus_per_node),
                "nvidia.com/gpu.present": "true",
            }
        return labels

    def node_objects(self) -> list[Obj]:
        gpus = str(self.gpus_per_node if self.gpu_product is not None else 0)
        resources = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: gpus}
        return [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {**self.labels(), "kubernetes.io/hostname": name}},
                "spec": {},
                "status": {
                    "capacity": resources,
                    "allocatable": resources,
                    "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                },
            }
            for name in self.node_names()
        ]


class PodIpAllocator:
    """Distinct loopback addresses 127.X.Y.Z from a random block, so concurrent clusters rarely collide."""

    def __init__(self, rng: random.Random | None = None) -> None:
        rng = rng or random.Random()
        self._second = rng.randint(16, 250)
        self._next = rng.randint(0, 255) * 254

    def allocate(self) -> str:
        third, host = divmod(self._next % (256 * 254), 254)
        self._next += 1
        return f"127.{self._second}.{third}.{host + 1}"


def requests_gpu(pod_spec: Mapping[str, Any]) -> bool:
    for container in pod_spec.get("containers") or []:
        resources = container.get("resources") or {}
        for amounts in (resources.get("limits") or {}, resources.get("requests") or {}):
            if str(amounts.get(GPU_RESOURCE, "0")) not in ("0", ""):
                return True
    return False


def counts_against_capacity(pod_spec: Mapping[str, Any]) -> bool:
    """GPU pods are those asking for GPUs or pinned to a pool by nodeSelector; only they use pool capacity."""
    return requests_gpu(pod_spec) or bool(pod_spec.get("nodeSelector"))


def schedule(
    pod_spec: Mapping[str, Any], nodes: Sequence[Obj], pools: Mapping[str, NodePool], used: Mapping[str, int]
) -> tuple[str | None, str]:
    """Pick a node for a pod: (node name, "") or (None, why it is unschedulable). `used`: GPU pods per pool."""
    selector = pod_spec.get("nodeSelector") or {}
    counted = counts_against_capacity(pod_spec)
    matching = [node for node in nodes if all(node["metadata"]["labels"].get(k) == v for k, v in selector.items())]
    if not matching:
        return None, f"0/{len(nodes)} nodes are available: {len(nodes)} node(s) didn't match Pod's node selector"
    if requests_gpu(pod_spec):
        matching = [node for node in matching if GPU_PRODUCT_LABEL in node["metadata"]["labels"]]
    elif not selector:
        cpu_nodes = [node for node in matching if node["metadata"]["labels"].get(POOL_LABEL) == CPU_POOL]
        matching = cpu_nodes or matching
    for node in matching:
        pool = pools.get(node["metadata"]["labels"].get(POOL_LABEL, ""))
        if not counted or pool is None or pool.capacity_pods is None or used.get(pool.name, 0) < pool.capacity_pods:
            return node["metadata"]["name"], ""
    return None, f"0/{len(nodes)} nodes are available: insufficient {GPU_RESOURCE}"


# http://NAME.NAMESPACE.svc[.cluster.local][:PORT] and http://NAME[:PORT]: what in-cluster DNS would resolve.
_SERVICE_URL = re.compile(
    r"http://(?P<name>[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)"
    r"(?:\.(?P<namespace>[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\.svc(?:\.cluster\.local)?)?"
    r"(?::(?P<port>\d+))?(?![\w.-])"
)


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _target_port(service_port: Mapping[str, Any], pod: Mapping[str, Any]) -> int:
    target = service_port.get("targetPort", service_port["port"])
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    raise LookupError(f"no container port named {target!r}")


def _resolver(namespace: str, services: Iterable[Obj], pods: Iterable[Obj]) -> Callable[[re.Match[str]], str | None]:
    """Resolve one matched Service URL to `http://<ready pod IP>:<targetPort>`, or None when it cannot be."""
    by_key = {(svc["metadata"]["namespace"], svc["metadata"]["name"]): svc for svc in services}
    ready_pods = sorted((pod for pod in pods if _is_ready(pod)), key=lambda pod: pod["metadata"]["name"])

    def resolve(match: re.Match[str]) -> str | None:
        service = by_key.get((match["namespace"] or namespace, match["name"]))
        if service is None:
            return None
        port = int(match["port"] or 80)
        service_ports = [p for p in service["spec"].get("ports") or [] if int(p["port"]) == port]
        selector = service["spec"].get("selector")
        for pod in ready_pods:
            same_namespace = pod["metadata"]["namespace"] == service["metadata"]["namespace"]
            if service_ports and same_namespace and match_labels(selector, pod["metadata"].get("labels") or {}):
                try:
                    return f"http://{pod['status']['podIP']}:{_target_port(service_ports[0], pod)}"
                except LookupError:
                    continue
        return None

    return resolve


def rewrite_service_urls(text: str, namespace: str, services: Iterable[Obj], pods: Iterable[Obj]) -> str:
    """Replace Service URLs with `http://<ready pod IP>:<targetPort>`: the stand-in for cluster DNS + kube-proxy.

    URLs naming no known Service, or a Service with no ready pod, are left as they are.
    """
    resolve = _resolver(namespace, services, pods)
    return _SERVICE_URL.sub(lambda match: resolve(match) or match[0], text)


def unresolved_service_urls(text: str, namespace: str, services: Iterable[Obj], pods: Iterable[Obj]) -> list[str]:
    """Service URLs in `text` that cannot reach a ready pod yet.

    That is every `NAME.NAMESPACE.svc` URL that does not resolve, and short `http://NAME` URLs naming an existing
    Service without a ready pod (other short URLs, like http://localhost:8000, are not Service URLs).
    """
    services = list(services)
    resolve = _resolver(namespace, services, pods)
    names = {(svc["metadata"]["namespace"], svc["metadata"]["name"]) for svc in services}
    return [
        match[0]
        for match in _SERVICE_URL.finditer(text)
        if (match["namespace"] or (namespace, match["name"]) in names) and resolve(match) is None
    ]
