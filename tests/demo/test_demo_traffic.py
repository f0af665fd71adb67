from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from demo_helpers import eventually
from kvpolicy_dev.demo.prometheus import free_loopback_port
from kvpolicy_dev.demo.traffic import Route, TrafficGenerator, endpoints, prompt_of
from kvpolicy_dev.sim import tokenizer
from kvpolicy_dev.sim.config import SimConfig
from kvpolicy_dev.sim.server import serve

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SELECTOR = {"app.kubernetes.io/name": "llama"}


def _pod(name: str, ip: str, *, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "labels": SELECTOR if labels is None else labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _route(port: int) -> Route:
    return Route("default", "llama", SELECTOR, port, MODEL, prompt_tokens=2048)


def test_prompt_has_exactly_the_requested_tokens() -> None:
    assert tokenizer.count(prompt_of(2048)) == 2048
    with pytest.raises(ValueError, match="at least one token"):
        prompt_of(0)


def test_endpoints_are_the_ready_pods_the_service_selects() -> None:
    pods = [
        _pod("b", "127.0.0.3"),
        _pod("a", "127.0.0.2"),
        _pod("starting", "127.0.0.4", ready=False),
        _pod("other-app", "127.0.0.5", labels={"app.kubernetes.io/name": "gemma"}),
        {**_pod("going", "127.0.0.6"), "metadata": {**_pod("going", "x")["metadata"], "deletionTimestamp": "t"}},
    ]
    assert endpoints(_route(8000), pods) == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]


def test_generator_rejects_a_zero_rate() -> None:
    with pytest.raises(ValueError, match="requests_per_second"):
        TrafficGenerator([], list, requests_per_second=0, max_tokens=8)


async def test_requests_are_spread_over_ready_pods_and_failures_are_counted() -> None:
    port = free_loopback_port()
    config = SimConfig(served_model_name=MODEL, time_scale=0.0)
    pods = [_pod("a", "127.0.0.2"), _pod("b", "127.0.0.3")]
    async with contextlib.AsyncExitStack() as stack:
        for ip in ("127.0.0.2", "127.0.0.3"):
            await stack.enter_async_context(serve(config, ip, port))
        generator = TrafficGenerator([_route(port)], lambda: pods, requests_per_second=50, max_tokens=4)
        task = asyncio.create_task(generator.run())
        counters = generator.counters["llama"]
        await eventually(lambda: counters.succeeded >= 10, within=20)
        # A pod that stops answering costs failed requests, not the generator.
        pods.append(_pod("dead", "127.0.0.9"))
        await eventually(lambda: counters.failed >= 2, within=20)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert set(counters.by_endpoint) == {f"http://127.0.0.{n}:{port}" for n in (2, 3, 9)}
    assert (
        counters.by_endpoint[f"http://127.0.0.2:{port}"] >= 4 and counters.by_endpoint[f"http://127.0.0.3:{port}"] >= 4
    )
