from __future__ import annotations

from typing import Any

import aiohttp
from kvpolicy_dev.demo.gate_progress import canary_endpoints, canary_requests, finished_requests
from kvpolicy_dev.demo.prometheus import free_loopback_port
from kvpolicy_dev.sim.config import SimConfig
from kvpolicy_dev.sim.server import serve

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EXPOSITION = """# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def _pod(name: str, ip: str | None, policy: str = "llama", role: str = "canary") -> dict[str, Any]:
    labels = {"kvpolicy.dev/policy": policy, "kvpolicy.dev/role": role}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 8000}]}]},
        "status": {"podIP": ip} if ip else {},
    }


def test_finished_requests_sums_every_finish_reason() -> None:
    assert finished_requests(EXPOSITION) == 7
    assert finished_requests("") == 0


def test_only_canary_pods_with_an_ip_are_read() -> None:
    pods = [
        _pod("c1", "127.0.0.2"),
        _pod("c2", "127.0.0.3", policy="gemma"),
        _pod("baseline", "127.0.0.4", role="baseline"),
        _pod("starting", None),
    ]
    assert canary_endpoints(pods) == {
        "llama": ["http://127.0.0.2:8000/metrics"],
        "gemma": ["http://127.0.0.3:8000/metrics"],
    }


async def test_canary_requests_counts_what_the_canary_answered() -> None:
    port = free_loopback_port()
    async with (
        serve(SimConfig(served_model_name=MODEL, time_scale=0.0), "127.0.0.2", port),
        aiohttp.ClientSession() as http,
    ):
        for _ in range(3):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
            async with http.post(f"http://127.0.0.2:{port}/v1/completions", json=body) as response:
                assert response.status == 200
        pods = [_pod("c1", "127.0.0.2"), _pod("gone", "127.0.0.9", policy="gemma")]
        for pod in pods:
            pod["spec"]["containers"][0]["ports"][0]["containerPort"] = port
        # An unreachable canary is left out rather than counted as zero.
        assert await canary_requests(http, pods, ["llama", "gemma", "other"]) == {"llama": 3}
