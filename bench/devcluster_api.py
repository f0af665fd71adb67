"""How fast the dev cluster answers: API calls over HTTP, watch delivery, pods becoming ready, a kopf round trip.

Usage: .venv/bin/python bench/devcluster_api.py [--requests 300]
Prints a Markdown table of medians (and 90th percentiles) for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import kopf
import kubernetes
from kopf.testing import KopfRunner
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster

NS = "default"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "benches.bench.dev"},
    "spec": {
        "group": "bench.dev",
        "scope": "Namespaced",
        "names": {"plural": "benches", "singular": "bench", "kind": "Bench"},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}}}],
    },
}


def summary(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered) * 1e3:.1f} ms | {p90 * 1e3:.1f} ms | {len(ordered)}"


async def timed(count: int, call: Callable[[int], Awaitable[Any]]) -> list[float]:
    times = []
    for index in range(count):
        start = time.perf_counter()
        await call(index)
        times.append(time.perf_counter() - start)
    return times


async def api_calls(cluster: ThreadedDevCluster, count: int) -> dict[str, list[float]]:
    merge = {"Content-Type": "application/merge-patch+json"}
    json_patch = {"Content-Type": "application/json-patch+json"}
    async with aiohttp.ClientSession(base_url=cluster.url) as http:

        async def request(method: str, url: str, status: int, **kwargs: Any) -> Any:
            async with http.request(method, url, **kwargs) as response:
                assert response.status == status, await response.text()
                return await response.json()

        async def create(i: int) -> None:
            body = {"metadata": {"name": f"c{i}", "labels": {"shard": str(i % 10)}}, "data": {"k": "v"}}
            await request("POST", CONFIGMAPS, 201, json=body)

        async def guarded_patch(i: int) -> None:
            current = await request("GET", f"{CONFIGMAPS}/c{i}", 200)
            ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": current["metadata"]["resourceVersion"]},
                   {"op": "add", "path": "/data/j", "value": str(i)}]  # fmt: skip
            await request("PATCH", f"{CONFIGMAPS}/c{i}", 200, data=json.dumps(ops), headers=json_patch)

        results = {"create (POST, 201)": await timed(count, create)}
        results["get"] = await timed(count, lambda i: request("GET", f"{CONFIGMAPS}/c{i}", 200))
        patch = json.dumps({"data": {"k": "w"}})
        results["merge patch"] = await timed(
            count, lambda i: request("PATCH", f"{CONFIGMAPS}/c{i}", 200, data=patch, headers=merge)
        )
        results["get + JSON patch with a resourceVersion test"] = await timed(count, guarded_patch)
        results[f"list with labelSelector ({count // 10} of {count})"] = await timed(
            50, lambda i: request("GET", f"{CONFIGMAPS}?labelSelector=shard={i % 10}", 200)
        )
        async with http.get(f"{CONFIGMAPS}?watch=true&resourceVersion={cluster.cluster.store.resource_version}") as w:
            latencies = []
            for i in range(50):
                start = time.perf_counter()
                cluster.patch("v1", "ConfigMap", f"c{i}", {"data": {"w": str(i)}}, NS)
                await w.content.readline()
                latencies.append(time.perf_counter() - start)
        results["write -> watch event delivered"] = latencies
    return results


def deployment(name: str, container: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "containers": [container],
                },
            },
        },
    }


def readiness(cluster: ThreadedDevCluster, runs: int) -> dict[str, list[float]]:
    def available(obj: dict[str, Any]) -> bool:
        return bool(obj.get("status", {}).get("availableReplicas") == 1)

    def completed(obj: dict[str, Any]) -> bool:
        return bool(obj.get("status", {}).get("succeeded") == 1)

    plain, simulated, jobs = [], [], []
    for run in range(runs):
        start = time.perf_counter()
        cluster.create(deployment(f"plain-{run}", {"name": "main", "image": "nginx"}))
        cluster.wait_for("apps/v1", "Deployment", f"plain-{run}", NS, available)
        plain.append(time.perf_counter() - start)
        vllm = {"name": "vllm", "image": "vllm", "command": ["vllm", "serve"], "args": ["meta-llama/Llama-3.1-8B"]}
        start = time.perf_counter()
        cluster.create(deployment(f"sim-{run}", vllm))
        cluster.wait_for("apps/v1", "Deployment", f"sim-{run}", NS, available)
        simulated.append(time.perf_counter() - start)
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"job-{run}", "namespace": NS},
               "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
                   {"name": "main", "image": "python", "command": ["python", "-c", "pass"]}]}}}}  # fmt: skip
        start = time.perf_counter()
        cluster.create(job)
        cluster.wait_for("batch/v1", "Job", f"job-{run}", NS, completed)
        jobs.append(time.perf_counter() - start)
    return {
        "Deployment available, no process": plain,
        "Deployment available, `kvpolicy sim` answering /health": simulated,
        "Job complete (`python -c pass`)": jobs,
    }


def kopf_round_trips(cluster: ThreadedDevCluster, runs: int) -> dict[str, list[float]]:
    """Start a kopf operator, have it patch a new object's status, stop it: what one kopf e2e test costs."""
    cluster.apply(CRD)
    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig))
    api = kubernetes.client.CustomObjectsApi()
    times = []
    for run in range(runs):
        registry = kopf.OperatorRegistry()
        kopf.on.login(registry=registry)(kopf.login_via_client)

        @kopf.on.create("bench.dev", "v1", "benches", registry=registry)
        def handle(patch: kopf.Patch, **_: object) -> None:
            patch.status["handled"] = True

        start = time.perf_counter()
        with KopfRunner(["run", "--standalone", "--namespace", NS], registry=registry, timeout=60):
            body = {"apiVersion": "bench.dev/v1", "kind": "Bench", "metadata": {"name": f"b{run}"}}
            api.create_namespaced_custom_object("bench.dev", "v1", NS, "benches", body)
            cluster.wait_for("bench.dev/v1", "Bench", f"b{run}", NS, lambda o: o.get("status", {}).get("handled"))
        times.append(time.perf_counter() - start)
    return {"KopfRunner start, create, status patched, stop": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300, help="API calls per kind of call")
    parser.add_argument("--runs", type=int, default=5, help="repetitions of the readiness and kopf measurements")
    args = parser.parse_args(argv)
    with ThreadedDevCluster(runner=SimulatorRunner(time_scale=0.001)) as cluster:
        env = cluster.environ()
        kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION = env["KUBECONFIG"]
        results = asyncio.run(api_calls(cluster, args.requests))
        results |= readiness(cluster, args.runs)
        results |= kopf_round_trips(cluster, args.runs)
    print("| what | median | p90 | n |\n|---|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {summary(seconds)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
