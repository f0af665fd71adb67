"""Users behind an HTTPRoute, for the end-to-end tests of traffic InferencePool: a stand-in for a gateway's data plane.

Each request follows the route as it is in the cluster now: the first rule's backendRefs are chosen by their weights
(smooth weighted round-robin, as Envoy and nginx do), and a ready pod of the chosen InferencePool (by its selector)
answers it. The route and pools are re-read before every request, so a weight the operator writes takes effect at
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
from e2e_helpers import in_background
from kvpolicy_dev.demo.traffic import prompt_of
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.kubelet import is_ready
from kvpolicy_dev.devcluster.selectors import match_labels

ROUTE_API = ("gateway.networking.k8s.io/v1", "HTTPRoute")
POOL_API = ("inference.networking.k8s.io/v1", "InferencePool")


class WeightedPicker:
    """Smooth weighted round-robin over (name, weight): over any run of sum(weights) picks, each name is picked
    exactly its weight's times, interleaved."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}

    def pick(self, weights: Mapping[str, int]) -> str | None:
        live = {name: weight for name, weight in weights.items() if weight > 0}
        if not live:
            return None
        for name, weight in live.items():
            self._current[name] = self._current.get(name, 0) + weight
        chosen = max(live, key=lambda name: (self._current[name], name))
        self._current[chosen] -= sum(live.values())
        return chosen


def route_weights(route: Mapping[str, Any]) -> dict[str, int]:
    """The first rule's InferencePool backends and their weights (Gateway API's default weight is 1)."""
    refs = route["spec"]["rules"][0].get("backendRefs") or []
    return {ref["name"]: int(ref.get("weight", 1)) for ref in refs if ref.get("kind") == "InferencePool"}


class RouteUsers:
    """Sends completions through the route until stopped; `served` counts the requests each pool answered."""

    def __init__(self, cluster: ThreadedDevCluster, namespace: str, route: str, model: str, rate: float) -> None:
        self.cluster, self.namespace, self.route, self.model = cluster, namespace, route, model
        self.interval = 1.0 / rate
        self.served: Counter[str] = Counter()
        self.failed = 0
        self._picker = WeightedPicker()
        self._turn = itertools.count()

    def _endpoint(self) -> tuple[str, str] | None:
        route = self.cluster.find(*ROUTE_API, self.route, self.namespace)
        if route is None:
            return None
        pool_name = self._picker.pick(route_weights(route))
        pool = self.cluster.find(*POOL_API, pool_name, self.namespace) if pool_name else None
        if pool_name is None or pool is None:
            return None
        selector = pool["spec"]["selector"]["matchLabels"]
        port = pool["spec"]["targetPorts"][0]["number"]
        pods = sorted(
            f"http://{pod['status']['podIP']}:{port}"
            for pod in self.cluster.list("v1", "Pod", self.namespace)
            if match_labels(selector, pod["metadata"].get("labels") or {})
            and is_ready(pod)
            and not pod["metadata"].get("deletionTimestamp")
        )
        return (pool_name, pods[next(self._turn) % len(pods)]) if pods else None

    async def run(self) -> None:
        body = {"model": self.model, "prompt": prompt_of(64), "max_tokens": 4}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            while True:
                chosen = await asyncio.to_thread(self._endpoint)
                if chosen is not None:
                    pool, url = chosen
                    try:
                        async with session.post(f"{url}/v1/completions", json=body) as response:
                            await response.read()
                            ok = response.status == 200
                    except (aiohttp.ClientError, TimeoutError):
                        ok = False
                    if ok:
                        self.served[pool] += 1
                    else:
                        self.failed += 1
                await asyncio.sleep(self.interval)


@contextlib.contextmanager
def route_users(
    cluster: ThreadedDevCluster, namespace: str, route: str, model: str, rate: float = 20.0
) -> Iterator[RouteUsers]:
    users = RouteUsers(cluster, namespace, route, model, rate)
    with in_background(users.run):
        yield users
