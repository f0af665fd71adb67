"""`kvpolicy run` as a process: it serves /healthz and /metrics and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request

from e2e_helpers import wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            body: str = response.read().decode()
            return body
    except OSError:
        return None


def test_kvpolicy_run_serves_liveness_and_metrics(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, kvpolicy_crd: None
) -> None:
    liveness, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "kvpolicy", "run", "--namespace", devcluster_namespace,
            "--liveness-port", str(liveness), "--metrics-port", str(metrics)]  # fmt: skip
    env = {**os.environ, **devcluster.environ()}
    operator = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: fetch(f"http://127.0.0.1:{liveness}/healthz"), "kopf's liveness endpoint", timeout=60)
        exposition = wait_until(lambda: fetch(f"http://127.0.0.1:{metrics}/metrics"), "the metrics endpoint")
        assert "kvpolicy_build_info" in exposition
    finally:
        operator.send_signal(signal.SIGTERM)
        output, _ = operator.communicate(timeout=60)
    assert operator.returncode == 0, output
