"""Memory of the candidate Kubernetes clients: importing each, and holding 1,000 Deployments as its objects.

Each measurement runs in a fresh interpreter: resident set size after `import json` (the floor), after importing the
library's client and config loader, and after decoding 1,000 Deployment documents (the shape of a vLLM target,
~1.4 KB of JSON each) into the library's objects and keeping them. `dict` keeps the parsed JSON, as the operator
does. Needs a virtualenv holding all three libraries (only kubernetes_asyncio is a dependency of the operator):

    python -m venv /tmp/clients && /tmp/clients/bin/pip install kubernetes_asyncio lightkube kr8s
    /tmp/clients/bin/python bench/kube_client_memory.py
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from datetime import UTC, datetime

COUNT = 1000
CHILD = """
import json, sys
def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
library, count = sys.argv[1], int(sys.argv[2])
floor = rss_kib()
if library == "kubernetes_asyncio":
    from kubernetes_asyncio import client, config
    api = client.ApiClient.__new__(client.ApiClient)  # decoding needs no connection pool (and no event loop)
    decode = lambda doc: api._ApiClient__deserialize(doc, "V1Deployment")  # what the generated methods return
elif library == "lightkube":
    import lightkube, lightkube.config.kubeconfig
    from lightkube.resources.apps_v1 import Deployment
    decode = Deployment.from_dict
elif library == "kr8s":
    import kr8s.asyncio
    from kr8s.asyncio.objects import Deployment
    decode = Deployment
else:
    decode = lambda doc: doc
imported = rss_kib()
template = json.loads(sys.stdin.read())
docs = []
for index in range(count):
    doc = json.loads(json.dumps(template).replace("NAME", f"model-{index}"))
    docs.append(decode(doc))
held = rss_kib()
print(json.dumps({"floor": floor, "imported": imported, "held": held}))
"""


def deployment() -> dict[str, object]:
    container = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.12.0",
        "args": ["serve", "NAME", "--max-model-len", "131072", "--gpu-memory-utilization", "0.92"],
        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
        "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "64Gi"}, "requests": {"cpu": "8"}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "NAME",
            "namespace": "models",
            "uid": "0b0e4f0c-1d2e-4f5a-8b7c-9d0e1f2a3b4c",
            "resourceVersion": "123456",
            "generation": 3,
            "labels": {"app": "NAME", "team": "inference"},
            "annotations": {"deployment.kubernetes.io/revision": "3"},
        },
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "NAME"}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": {"app": "NAME"}},
                "spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}, "containers": [container]},
            },
        },
        "status": {"replicas": 2, "readyReplicas": 2, "availableReplicas": 2, "observedGeneration": 3},
    }


def measure(library: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, library, str(COUNT)],
        input=json.dumps(deployment()),
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, int] = json.loads(done.stdout)
    return result


def main() -> int:
    size = len(json.dumps(deployment()))
    machine = f"{platform.machine()}, Python {platform.python_version()}"
    print(f"# {datetime.now(UTC):%Y-%m-%d} on {machine}; {COUNT} Deployments of {size} bytes of JSON each")
    print("| library | import (MiB over the floor) | 1,000 Deployments held (MiB) |")
    print("|---|---:|---:|")
    for library in ("dict", "kubernetes_asyncio", "lightkube", "kr8s"):
        rss = measure(library)
        imported = (rss["imported"] - rss["floor"]) / 1024
        held = (rss["held"] - rss["imported"]) / 1024
        print(f"| {library} | {imported:.1f} | {held:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
