"""The users of the demo: steady completion requests to each scenario's Service, spread over its ready pods.

Requests go round-robin to the ready pods the Service selects, as kube-proxy would, so a canary that joins the
Service (ReplicaRatio traffic) starts taking its share and the latency analysis has live traffic on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import aiohttp

from kvpolicy_dev.devcluster.kubelet import is_ready
from kvpolicy_dev.devcluster.selectors import match_labels

REQUEST_TIMEOUT_SECONDS = 30.0
# How often the generator re-reads the pods (a kube-proxy also lags the endpoints a little).
POD_REFRESH_SECONDS = 0.5
# One vocabulary word: a prompt of N copies is exactly N tokens for the simulator's tokenizer.
_PROMPT_WORD = " the"


@lru_cache(maxsize=16)
def prompt_of(tokens: int) -> str:
    """A prompt of exactly `tokens` tokens (the simulator counts tokens the way vLLM would for its model)."""
    if tokens < 1:
        raise ValueError(f"a prompt needs at least one token, not {tokens}")
    return _PROMPT_WORD * tokens


@dataclass(frozen=True)
class Route:
    """Where one scenario's users send requests: a Service (by its selector) and what they send."""

    namespace: str
    service: str
    selector: Mapping[str, str]
    port: int
    model: str
    prompt_tokens: int


def endpoints(route: Route, pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Base URLs of the ready pods behind the route's Service, sorted for a stable round-robin."""
    urls = []
    for pod in pods:
        meta = pod["metadata"]
        ip = (pod.get("status") or {}).get("podIP")
        in_service = meta.get("namespace") == route.namespace and match_labels(route.selector, meta.get("labels") or {})
        if in_service and ip and is_ready(pod) and not meta.get("deletionTimestamp"):
            urls.append(f"http://{ip}:{route.port}")
    return sorted(urls)


@dataclass
class RouteCounters:
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    by_endpoint: dict[str, int] = field(default_factory=dict)


class TrafficGenerator:
    """Sends `requests_per_second` completions per route until cancelled; `list_pods` reads the cluster's pods."""

    def __init__(
        self,
        routes: Sequence[Route],
        list_pods: Callable[[], list[dict[str, Any]]],
        *,
        requests_per_second: float,
        max_tokens: int,
        max_in_flight: int = 8,
    ) -> None:
        if requests_per_second <= 0:
            raise ValueError(f"requests_per_second must be above 0, got {requests_per_second}")
        self._routes = list(routes)
        self._list_pods = list_pods
        self._interval = 1.0 / requests_per_second
        self._max_tokens = max_tokens
        self._slots = asyncio.Semaphore(max_in_flight)
        self.counters = {route.service: RouteCounters() for route in self._routes}
        self._pods: list[dict[str, Any]] = []

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout) as session, asyncio.TaskGroup() as group:
            group.create_task(self._refresh_pods())
            for route in self._routes:
                group.create_task(self._drive(session, route))

    async def _refresh_pods(self) -> None:
        while True:
            self._pods = self._list_pods()
            await asyncio.sleep(POD_REFRESH_SECONDS)

    async def _drive(self, session: aiohttp.ClientSession, route: Route) -> None:
        counters = self.counters[route.service]
        body = {"model": route.model, "prompt": prompt_of(route.prompt_tokens), "max_tokens": self._max_tokens}
        turn = itertools.count()
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while True:
                urls = endpoints(route, self._pods)
                if urls and not self._slots.locked():
                    url = urls[next(turn) % len(urls)]
                    task = asyncio.create_task(self._send(session, url, body, counters))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                await asyncio.sleep(self._interval)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _send(
        self, session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], counters: RouteCounters
    ) -> None:
        counters.sent += 1
        counters.by_endpoint[url] = counters.by_endpoint.get(url, 0) + 1
        async with self._slots:
            ok = False
            # A pod going away mid-request is part of a rollout: count it, do not stop the users.
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    await response.read()
                    ok = response.status == 200
        if ok:
            counters.succeeded += 1
        else:
            counters.failed += 1
