"""The real-model tier: real vLLM (its CPU build) serving SmolLM2-135M-Instruct with real weights, so the accuracy
gate meets a real model's answers.

Three servers are started once for this package, at the same time (each takes 30-120 s on two cores and about 1.5 GB),
and stopped when its tests are done: the BF16 baseline, a canary that only sees the last WINDOW tokens (broken for
long prompts only), and the FP8-KV canary.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from analysis.live_fleet import free_port
from kvpolicy_dev.devcluster.cpu_vllm import start_server
from kvpolicy_dev.devcluster.pytest_plugin import REAL_VLLM_STARTUP_SECONDS
from realmodel_helpers import BF16_ARGS, FP8_ARGS, WINDOWED_ARGS, RealModelServers


@pytest.fixture(scope="package")
def real_model_servers(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealModelServers]:
    logs = tmp_path_factory.mktemp("real-model-logs")
    servers = {
        name: start_server(args, real_model, free_port(), logs / f"{name}.log")
        for name, args in (("baseline", BF16_ARGS), ("windowed", WINDOWED_ARGS), ("fp8", FP8_ARGS))
    }
    try:
        for name, server in servers.items():
            REAL_VLLM_STARTUP_SECONDS[f"real-model {name} server"] = server.wait_ready()
        yield RealModelServers(**servers)
    finally:
        for server in servers.values():
            server.stop()
