"""A local Prometheus that scrapes the dev cluster's vLLM pods, found through a file_sd target file the demo rewrites.

The target labels follow what kubernetes_sd relabeling gives in a real cluster (`namespace`, `pod`, and each pod label
with non-alphanumerics turned into `_`), so the operator's Prometheus provider queries it unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
import yaml

from kvpolicy_dev.demo.processes import ChildProcess
from kvpolicy_dev.devcluster.kubelet import is_ready

READY_TIMEOUT_SECONDS = 30.0
SCRAPE_INTERVAL = "1s"


def find_prometheus() -> str | None:
    return shutil.which("prometheus")


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def prometheus_config(targets_file: Path) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "vllm",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": SCRAPE_INTERVAL}],
            }
        ],
    }


def _label_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def scrape_targets(pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """file_sd entries for the ready pods whose first container declares a port (the model servers)."""
    targets = []
    for pod in pods:
        containers = (pod.get("spec") or {}).get("containers") or []
        ports = (containers[0].get("ports") or []) if containers else []
        ip = (pod.get("status") or {}).get("podIP")
        if not ports or not ip or not is_ready(pod):
            continue
        meta = pod["metadata"]
        labels = {_label_name(key): str(value) for key, value in (meta.get("labels") or {}).items()}
        labels |= {"namespace": meta["namespace"], "pod": meta["name"]}
        targets.append({"targets": [f"{ip}:{ports[0]['containerPort']}"], "labels": labels})
    return sorted(targets, key=lambda entry: (entry["labels"]["namespace"], entry["labels"]["pod"]))


class LocalPrometheus:
    """`async with LocalPrometheus(binary, workdir) as prometheus:` runs Prometheus on a free loopback port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self._workdir = workdir
        self.port = free_loopback_port()
        self.targets_file = workdir / "targets.json"
        self._written: list[dict[str, Any]] | None = None
        config = workdir / "prometheus.yml"
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self._config = config
        self.process = ChildProcess("prometheus", argv, workdir / "prometheus.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Self:
        self._workdir.mkdir(parents=True, exist_ok=True)
        self.write_targets([])
        self._config.write_text(yaml.safe_dump(prometheus_config(self.targets_file), sort_keys=False))
        await self.process.__aenter__()
        try:
            await self._wait_ready()
        except BaseException:
            await self.process.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.process.stop()

    async def _wait_ready(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
            async with asyncio.timeout(READY_TIMEOUT_SECONDS):
                while True:
                    self.process.check_running()
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with http.get(f"{self.url}/-/ready") as response:
                            if response.status == 200:
                                return
                    await asyncio.sleep(0.1)

    def write_targets(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """Rewrite the target file when the ready model servers changed (atomically: Prometheus watches it)."""
        targets = scrape_targets(pods)
        if targets == self._written:
            return
        partial = self.targets_file.with_suffix(".tmp")
        partial.write_text(json.dumps(targets, indent=1))
        os.replace(partial, self.targets_file)
        self._written = targets
