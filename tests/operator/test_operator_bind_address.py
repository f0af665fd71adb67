"""`kvpolicy run --liveness-address/--metrics-address`: where /healthz and /metrics listen (issue: both were fixed to
0.0.0.0). The default stays every address, which the kubelet's probes on the pod IP need."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from e2e_helpers import wait_until
from kvpolicy.runtime.run import _parser as run_parser
from kvpolicy_dev.devcluster import ThreadedDevCluster
from test_operator_run import fetch, free_port


def outward_address() -> str:
    """This machine's address on its default route (the pod IP, in a pod); skip where there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's source address
        except OSError:
            pytest.skip("no non-loopback IPv4 address on this machine")
        address: str = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("no non-loopback IPv4 address on this machine")
    return address


@contextmanager
def running_operator(cluster: ThreadedDevCluster, namespace: str, *flags: str) -> Iterator[tuple[int, int]]:
    liveness, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "kvpolicy", "run", "--namespace", namespace,
            "--liveness-port", str(liveness), "--metrics-port", str(metrics), *flags]  # fmt: skip
    env = {**os.environ, **cluster.environ()}
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: fetch(f"http://127.0.0.1:{liveness}/healthz"), "kopf's liveness endpoint", timeout=60)
        wait_until(lambda: fetch(f"http://127.0.0.1:{metrics}/metrics"), "the metrics endpoint")
        yield liveness, metrics
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output


def test_loopback_addresses_are_not_reachable_from_outside(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, kvpolicy_crd: None
) -> None:
    outside = outward_address()
    loopback = ("--liveness-address", "127.0.0.1", "--metrics-address", "127.0.0.1")
    with running_operator(devcluster, devcluster_namespace, *loopback) as (liveness, metrics):
        assert fetch(f"http://{outside}:{liveness}/healthz") is None
        assert fetch(f"http://{outside}:{metrics}/metrics") is None
    with running_operator(devcluster, devcluster_namespace) as (liveness, metrics):
        assert fetch(f"http://{outside}:{liveness}/healthz") is not None
        assert "kvpolicy_build_info" in (fetch(f"http://{outside}:{metrics}/metrics") or "")


def test_an_address_that_is_not_an_ip_is_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        run_parser().parse_args(["-A", "--metrics-address", "localhost:9090"])
    assert stopped.value.code == 2
    assert "argument --metrics-address: 'localhost:9090' is not an IP address" in capsys.readouterr().err
    assert run_parser().parse_args(["-A", "--liveness-address", "::"]).liveness_address == "::"
