from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import pytest
import yaml
from kvpolicy_dev.demo.prometheus import LocalPrometheus, find_prometheus, prometheus_config, scrape_targets


def _pod(name: str, ip: str | None, *, ready: bool = True, ports: bool = True) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "vllm"}
    if ports:
        container["ports"] = [{"containerPort": 8000}]
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {"name": name, "namespace": "default", "labels": {"app.kubernetes.io/name": "llama"}},
        "spec": {"containers": [container]},
        "status": status,
    }


def test_targets_carry_namespace_pod_and_relabelled_pod_labels() -> None:
    [entry] = scrape_targets([_pod("llama-1", "127.20.0.1")])
    assert entry == {
        "targets": ["127.20.0.1:8000"],
        "labels": {"app_kubernetes_io_name": "llama", "namespace": "default", "pod": "llama-1"},
    }


def test_only_ready_pods_with_a_server_port_are_scraped() -> None:
    pods = [
        _pod("b", "127.20.0.2"),
        _pod("a", "127.20.0.3"),
        _pod("not-ready", "127.20.0.4", ready=False),
        _pod("no-ip", None),
        _pod("gate-job", "127.20.0.5", ports=False),
    ]
    assert [entry["labels"]["pod"] for entry in scrape_targets(pods)] == ["a", "b"]


def test_config_reads_the_target_file(tmp_path: Path) -> None:
    config = prometheus_config(tmp_path / "targets.json")
    [job] = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "targets.json")]


async def _serve_metrics(host: str) -> aiohttp.web.AppRunner:
    async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text='vllm:num_requests_running{model_name="m"} 3\n')

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", metrics)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, 8000).start()
    return runner


@pytest.mark.prometheus
@pytest.mark.skipif(find_prometheus() is None, reason="prometheus is not installed")
async def test_local_prometheus_scrapes_targets_and_stops_its_process(tmp_path: Path) -> None:
    binary = find_prometheus()
    assert binary is not None
    server = await _serve_metrics("127.0.0.1")
    try:
        async with LocalPrometheus(binary, tmp_path) as prometheus, aiohttp.ClientSession() as http:
            assert yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"]
            prometheus.write_targets([_pod("llama-1", "127.0.0.1")])
            assert json.loads(prometheus.targets_file.read_text())[0]["labels"]["pod"] == "llama-1"
            query = 'vllm:num_requests_running{pod="llama-1", namespace="default"}'
            result: list[Any] = []
            async with asyncio.timeout(30):
                while not result:
                    await asyncio.sleep(0.5)
                    async with http.get(f"{prometheus.url}/api/v1/query", params={"query": query}) as response:
                        result = (await response.json())["data"]["result"]
            assert result[0]["value"][1] == "3"
            pid = prometheus.process.pid
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    finally:
        await server.cleanup()
