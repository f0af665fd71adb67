"""The scrape job the Prometheus Operator generates for a ServiceMonitor endpoint, for a real Prometheus to run.

The relabelling follows the operator's generator (prometheus-operator `pkg/prometheus/promcfg.go`, as its golden test
files show, e.g. `pkg/prometheus/testdata/NoEnforcedNamespaceLabelServiceMonitor_Expected.golden`): keep the Service's
selected labels and the endpoint's port, then set the target labels `namespace`, `service`, `pod`, `container`, `job`
(the Service's name) and `endpoint`, and `honor_labels` from the endpoint's `honorLabels` (default false).

There is no Kubernetes here, so the service-discovery half is a static target carrying the `__meta_kubernetes_*`
labels that `kubernetes_sd_configs` role `endpoints` gives an endpoint address backed by a pod; the relabelling is
then exactly the generated one.
"""

from __future__ import annotations

import re
from typing import Any


def _sanitized(label: str) -> str:
    """A Kubernetes label name as service discovery spells it in `__meta_kubernetes_service_label_<name>`."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def endpoints_target(address: str, service: dict[str, Any], pod: str, container: str, port: str) -> dict[str, Any]:
    """The static target standing for what endpoints discovery finds: `address` served by `pod` behind `service`."""
    labels = {
        "__meta_kubernetes_namespace": service["metadata"]["namespace"],
        "__meta_kubernetes_service_name": service["metadata"]["name"],
        "__meta_kubernetes_endpoint_port_name": port,
        "__meta_kubernetes_endpoint_ready": "true",
        "__meta_kubernetes_endpoint_address_target_kind": "Pod",
        "__meta_kubernetes_endpoint_address_target_name": pod,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_pod_phase": "Running",
    }
    for name, value in service["metadata"].get("labels", {}).items():
        labels[f"__meta_kubernetes_service_label_{_sanitized(name)}"] = str(value)
        labels[f"__meta_kubernetes_service_labelpresent_{_sanitized(name)}"] = "true"
    return {"targets": [address], "labels": labels}


def _selected(monitor: dict[str, Any], role: str) -> list[dict[str, Any]]:
    """The generator's first relabellings: remember the job, keep the targets whose `role` (service, pod) carries
    every label of the monitor's matchLabels."""
    relabel: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    for label, value in sorted(monitor["spec"]["selector"].get("matchLabels", {}).items()):
        present = [f"__meta_kubernetes_{role}_label_{_sanitized(label)}"]
        present.append(f"__meta_kubernetes_{role}_labelpresent_{_sanitized(label)}")
        relabel.append({"action": "keep", "source_labels": present, "regex": f"({value});true"})
    return relabel


def _job(
    name: str, endpoint: dict[str, Any], interval: str, targets: list[dict[str, Any]], relabel: list[dict[str, Any]]
) -> dict[str, Any]:
    job: dict[str, Any] = {
        "job_name": name,
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path", "/metrics"),
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "static_configs": targets,
        "relabel_configs": relabel,
    }
    if endpoint.get("params"):
        job["params"] = endpoint["params"]
    return job


def scrape_config(
    monitor: dict[str, Any], targets: list[dict[str, Any]], interval: str, endpoint_index: int = 0
) -> dict[str, Any]:
    """The job for endpoint `endpoint_index` of the ServiceMonitor `monitor`, over the discovered `targets`."""
    endpoint = monitor["spec"]["endpoints"][endpoint_index]
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    relabel = _selected(monitor, "service")
    relabel.append(
        {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": endpoint["port"]}
    )
    target = ["__meta_kubernetes_endpoint_address_target_kind", "__meta_kubernetes_endpoint_address_target_name"]
    relabel += [
        {
            "source_labels": target,
            "separator": ";",
            "regex": "Node;(.*)",
            "replacement": "${1}",
            "target_label": "node",
        },
        {"source_labels": target, "separator": ";", "regex": "Pod;(.*)", "replacement": "${1}", "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    return _job(f"serviceMonitor/{namespace}/{name}/{endpoint_index}", endpoint, interval, targets, relabel)


def pod_target(
    address: str, namespace: str, pod: str, container: str, port: str, labels: dict[str, str]
) -> dict[str, Any]:
    """The static target standing for what pod discovery (`kubernetes_sd_configs` role `pod`) finds: one container
    port of a running pod with `labels`."""
    meta = {
        "__meta_kubernetes_namespace": namespace,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_pod_container_port_name": port,
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_ready": "true",
    }
    for name, value in labels.items():
        meta[f"__meta_kubernetes_pod_label_{_sanitized(name)}"] = value
        meta[f"__meta_kubernetes_pod_labelpresent_{_sanitized(name)}"] = "true"
    return {"targets": [address], "labels": meta}


def _snake(relabeling: dict[str, Any]) -> dict[str, Any]:
    """A RelabelConfig as the CRDs spell it (sourceLabels, targetLabel) in Prometheus' own spelling."""
    return {re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), key): value for key, value in relabeling.items()}


def pod_monitor_scrape_config(
    monitor: dict[str, Any], targets: list[dict[str, Any]], interval: str, endpoint_index: int = 0
) -> dict[str, Any]:
    """The job for podMetricsEndpoint `endpoint_index` of the PodMonitor `monitor`, over the discovered `targets`
    (the generator's PodMonitor half: keep the selected pod labels, the endpoint's port name and running pods; set
    `namespace`, `container`, `pod`, `job` (<namespace>/<name>) and `endpoint`; then the endpoint's relabelings)."""
    endpoint = monitor["spec"]["podMetricsEndpoints"][endpoint_index]
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    relabel = _selected(monitor, "pod")
    relabel += [
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"]},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{namespace}/{name}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    relabel += [_snake(relabeling) for relabeling in endpoint.get("relabelings", [])]
    return _job(f"podMonitor/{namespace}/{name}/{endpoint_index}", endpoint, interval, targets, relabel)
