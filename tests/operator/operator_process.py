"""`kvpolicy run` as a process against the dev cluster, as a pod runs it: its own kubeconfig (a bearer token of its own,
so the API server's write log tells replicas apart), /healthz, /metrics, SIGTERM and SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from e2e_helpers import OPERATOR_ENV, wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster
from prometheus_client.parser import text_string_to_metric_families
from test_operator_run import free_port


@dataclass
class OperatorProcess:
    name: str  # its bearer token (the dev cluster's `user`) and its pod name
    process: subprocess.Popen[bytes]
    liveness_port: int
    metrics_port: int
    log: Path

    def healthz(self) -> tuple[int, dict[str, Any]] | None:
        """(status, body) of /healthz, or None while it does not answer."""
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())
        except OSError:
            return None

    def metric(self, name: str) -> float | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        return None

    def running(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as a node that dies takes its pods: nothing is released."""
        self.process.kill()
        self.process.wait(timeout=30)


def kubeconfig_for(cluster: ThreadedDevCluster, user: str, directory: Path) -> Path:
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"][0]["user"]["token"] = user
    path = directory / f"kubeconfig-{user}"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def operator_process(
    cluster: ThreadedDevCluster, directory: Path, name: str, *flags: str, env: Mapping[str, str] | None = None
) -> Iterator[OperatorProcess]:
    """Start `kvpolicy run FLAGS` and wait for /healthz; on exit SIGTERM it (unless dead) and expect exit code 0."""
    liveness, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "kvpolicy", "run", *flags,
            "--liveness-port", str(liveness), "--metrics-port", str(metrics)]  # fmt: skip
    environ = {**os.environ, **OPERATOR_ENV, "KUBECONFIG": str(kubeconfig_for(cluster, name, directory)), **(env or {})}
    log = directory / f"operator-{name}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(argv, env=environ, stdout=output, stderr=subprocess.STDOUT)
    operator = OperatorProcess(name, process, liveness, metrics, log)
    try:
        wait_until(lambda: operator.healthz() or not operator.running(), f"operator {name}'s /healthz", timeout=60)
        assert operator.running(), operator.output()
        yield operator
    finally:
        if operator.running():
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
            assert process.returncode == 0, operator.output()
