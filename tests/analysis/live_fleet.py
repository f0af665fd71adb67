"""Processes for the real-Prometheus tests: vLLM-like servers, a Prometheus scraping them, and a load driver.

Everything listens on 127.0.0.1. Processes are started by the tests and stopped by them (by their own handle).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.error import URLError
from urllib.parse import urlencode
from urllib.request import urlopen

import aiohttp

HERE = Path(__file__).parent
PROMETHEUS = shutil.which("prometheus")
SCRAPE_INTERVAL = "200ms"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        with urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (URLError, OSError):
        return False


@dataclass
class ServerProcess:
    """A server process standing for one pod (a vLLM-like server, or an operator serving its metrics)."""

    pod: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> ServerProcess:
        wait_until(lambda: _answers(f"{self.url}/metrics"), 30, f"{self.pod} to serve /metrics")
        return self

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def launch_simulator(pod: str, latency_multiplier: float = 1.0) -> ServerProcess:
    """Start `kvpolicy sim` as an FP8 canary on an H100 with the two-level fix; `wait_ready()` it."""
    port = free_port()
    command = [sys.executable, "-m", "kvpolicy", "sim", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--gpu", "h100", "--kv-cache-dtype", "fp8", "--two-level-fix", "--time-scale", "0.01"]
    command += ["--latency-multiplier", str(latency_multiplier), "--served-model-name", "m"]
    return ServerProcess(pod, port, subprocess.Popen(command, stderr=subprocess.DEVNULL))


def launch_process(pod: str, command: Sequence[str]) -> ServerProcess:
    """Start a server that takes `--port P` and serves /metrics; `wait_ready()` it."""
    port = free_port()
    return ServerProcess(pod, port, subprocess.Popen([*command, "--port", str(port)]))


def launch_fake_vllm(pod: str, *args: str) -> ServerProcess:
    """Start tests/analysis/fake_vllm.py (fixed latencies, configurable metric spellings); `wait_ready()` it."""
    return launch_process(pod, [sys.executable, str(HERE / "fake_vllm.py"), *args])


class PrometheusServer:
    """A Prometheus on a loopback port with a temporary data dir, scraping static targets and evaluating rules every
    200 ms. `scrape_configs` replaces the default job per target (namespace and pod as static labels)."""

    def __init__(
        self,
        targets: Sequence[ServerProcess],
        namespace: str = "llm",
        rule_files: Sequence[Path] = (),
        scrape_configs: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        if PROMETHEUS is None:
            raise FileNotFoundError("prometheus is not installed")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="kvpolicy-prometheus-")
        config = Path(self._dir.name) / "prometheus.yml"
        if scrape_configs is None:
            scrape_configs = [
                {
                    "job_name": target.pod,
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{target.port}"], "labels": {"namespace": namespace, "pod": target.pod}}
                    ],
                }
                for target in targets
            ]
        global_config = {
            "scrape_interval": SCRAPE_INTERVAL,
            "scrape_timeout": SCRAPE_INTERVAL,
            "evaluation_interval": SCRAPE_INTERVAL,
        }
        rules = [str(path) for path in rule_files]
        document = {"global": global_config, "scrape_configs": list(scrape_configs), "rule_files": rules}
        config.write_text(json.dumps(document))  # JSON is YAML
        self.log_path = Path(self._dir.name) / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.process = self._launch(config, log)
        ready = f"{self.url}/-/ready"
        try:
            wait_until(lambda: _answers(ready), 30, f"Prometheus to be ready (log: {self.log_tail()})")
            # Prometheus applies new targets a few seconds after start: wait until it scraped all of them.
            scraped = len(targets)
            wait_until(
                lambda: self.query_value("count(up == 1)") == scraped, 30, "Prometheus' first scrape of every pod"
            )
        except BaseException:
            self.stop()  # nobody else can: the caller never got this object
            raise

    def _launch(self, config: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir.name}/data",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def query(self, promql: str) -> list[dict[str, Any]]:
        with urlopen(f"{self.url}/api/v1/query?{urlencode({'query': promql})}", timeout=5) as response:
            result: list[dict[str, Any]] = json.load(response)["data"]["result"]
        return result

    def query_value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self._dir.cleanup()


async def drive_load(
    url: str, requests: int, concurrency: int = 8, max_tokens: int = 6, prompt: str = "x", model: str = "m"
) -> None:
    """Send `requests` streaming completions, at most `concurrency` at once, and read every stream to its end."""
    semaphore = asyncio.Semaphore(concurrency)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}

    async def one(session: aiohttp.ClientSession) -> None:
        async with semaphore, session.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.strip() == b"data: [DONE]":
                    return
            raise AssertionError(f"{url}: stream ended without [DONE]")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one(session) for _ in range(requests)))


# The fake pod has the simulated pods' latencies (fixed, in seconds) and exports `vllm_` names and ITL under its
# deprecated name, as an exporter that rewrites the colon and a vLLM older than 0.11 would.
OLD_SPELLINGS = ("--ttft", "0.048", "--itl", "0.0066", "--prefix", "vllm_")
OLD_SPELLINGS += ("--itl-name", "time_per_output_token_seconds")
# The simulator's H100 fit gives ~48 ms TTFT at this prompt length, the middle of vLLM's (40, 60] ms bucket, and 1.5x
# of it lands in the (60, 80] ms bucket. Its ITL is ~6.6 ms, and 1.3x of it (~8.6 ms) is still in vLLM's first ITL
# bucket, (0, 10] ms.
PROMPT = "the" + " the" * 1099
LOADED_REQUESTS = 60


@dataclass
class Fleet:
    """Pods of one namespace, each a process, and the Prometheus scraping them."""

    pods: dict[str, ServerProcess]
    prometheus: PrometheusServer

    @classmethod
    def start(cls) -> Fleet:
        launched = [
            launch_simulator("m-canary-0"),
            launch_simulator("m-baseline-0"),
            launch_simulator("m-slow-0", latency_multiplier=1.5),
            launch_simulator("m-decode-slow-0", latency_multiplier=1.3),
            launch_simulator("m-idle-0"),
            launch_fake_vllm("m-underscore-0", *OLD_SPELLINGS),
        ]
        try:
            pods = {pod.pod: pod.wait_ready() for pod in launched}
            prometheus = PrometheusServer(list(pods.values()))
        except BaseException:
            for pod in launched:
                pod.stop()
            raise
        fleet = cls(pods, prometheus)
        try:
            asyncio.run(fleet.load([name for name in pods if name != "m-idle-0"], LOADED_REQUESTS))
        except BaseException:
            fleet.stop()
            raise
        return fleet

    async def load(self, names: Sequence[str], requests: int, prometheus: PrometheusServer | None = None) -> None:
        """Serve `requests` more requests on each pod, one at a time (the simulator slows down under concurrency),
        and wait until Prometheus has scraped them all."""
        prometheus = prometheus or self.prometheus
        # The simulator creates its latency series on the first request (vLLM creates them at 0 on start-up), and
        # increase() cannot count a series' first value: serve one request first and let Prometheus see the series.
        targets = [self.pods[name] for name in names]
        counted = {pod.pod: self.requests_seen(prometheus, pod.pod) for pod in targets}

        async def serve(count: int, pods: Sequence[ServerProcess]) -> None:
            await asyncio.gather(*(drive_load(pod.url, count, concurrency=1, prompt=PROMPT) for pod in pods))

        fresh = [pod for pod in targets if counted[pod.pod] is None]
        await serve(1, fresh)
        for pod in fresh:
            counted[pod.pod] = self.wait_ingested(prometheus, pod.pod, 1)
        await serve(requests, targets)
        for pod in targets:
            self.wait_ingested(prometheus, pod.pod, (counted[pod.pod] or 0) + requests)

    @staticmethod
    def requests_seen(prometheus: PrometheusServer, pod: str) -> float | None:
        return prometheus.query_value(f'sum({{__name__=~"vllm[:_]time_to_first_token_seconds_count", pod="{pod}"}})')

    def wait_ingested(self, prometheus: PrometheusServer, pod: str, requests: float) -> float:
        wait_until(
            lambda: (self.requests_seen(prometheus, pod) or 0) >= requests, 30, f"Prometheus to see {pod}'s load"
        )
        return requests

    def stop(self) -> None:
        self.prometheus.stop()
        for pod in self.pods.values():
            pod.stop()
