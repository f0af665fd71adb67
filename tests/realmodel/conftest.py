"""The real-model tier: real vLLM (its CPU build) serving SmolLM2-135M-Instruct with real weights, so the accuracy
gate meets a real model's answers.

Three server configurations (realmodel_helpers.SERVER_ARGS): the BF16 baseline, a canary that only sees the last
WINDOW tokens (broken for long prompts only), and the FP8-KV canary. Each takes 30-120 s to start on two cores and
about 1.5 GB, so a server starts only when a test asks for it, once for this package, and stops when its tests are
done: the default run's tests take the baseline alone (`real_model_baseline`); the `longgate` ones take all three
(`real_model_servers`), started together.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmServer, RealVllmServerPool
from kvpolicy_dev.devcluster.pytest_plugin import REAL_VLLM_STARTUP_SECONDS
from realmodel_helpers import SERVER_ARGS, RealModelServers


@pytest.fixture(scope="package")
def real_model_pool(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVllmServerPool]:
    logs = tmp_path_factory.mktemp("real-model-logs")
    pool = RealVllmServerPool(real_model, logs, SERVER_ARGS, REAL_VLLM_STARTUP_SECONDS, "real-model")
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="package")
def real_model_baseline(real_model_pool: RealVllmServerPool) -> RealVllmServer:
    """The BF16 baseline server."""
    (baseline,) = real_model_pool.started("baseline")
    return baseline


@pytest.fixture(scope="package")
def real_model_servers(real_model_pool: RealVllmServerPool) -> RealModelServers:
    """The baseline, the windowed canary and the FP8-KV canary."""
    return RealModelServers(*real_model_pool.started("baseline", "windowed", "fp8"))
