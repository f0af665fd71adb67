"""The canary configuration check's parity on real vLLM 0.32 servers: an FP8 canary that differs from its BF16 baseline
only in the KV cache passes, one started with prefix caching off is a CanaryConfigMismatch naming the label. And the
version a real server reports is one the planner's version table knows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from analysis.live_fleet import free_port
from kvpolicy.analysis.checks import Sides
from kvpolicy.analysis.model import SideSelector
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.analysis.served import CANARY_CONFIG
from kvpolicy.api.v1alpha1 import GateVerdict, KVPolicy
from kvpolicy.planning.vllm_versions import parse_version, release
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmServer, start_server
from kvpolicy_dev.devcluster.pytest_plugin import REAL_VLLM_STARTUP_SECONDS
from realvllm_helpers import FP8_ARGS, SERVED_MODEL, SKIP_LAYERS, RealPair

pytestmark = pytest.mark.realvllm
NAMESPACE = "default"

# The plan the session's FP8 server runs (realvllm_helpers.FP8_ARGS).
POLICY = KVPolicy.model_validate(
    {
        "metadata": {"name": "parity", "namespace": NAMESPACE},
        "spec": {
            "targetRef": {"name": "tiny"},
            "model": {"servedModelName": SERVED_MODEL, "headDim": 64, "numLayers": 2, "maxModelLen": 8192},
            "workload": {"maxContextTokens": 8192, "typicalContextTokens": 8192},
        },
        "status": {
            "plan": {
                "kvCacheDtype": "FP8",
                "vllmKvCacheDtype": "fp8",
                "skipLayers": list(SKIP_LAYERS),
                "attentionBackend": "FLASH_ATTN",
            }
        },
    }
)


@pytest.fixture(scope="module")
def no_prefix_caching(cpu_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVllmServer]:
    """The FP8 canary as a wrapper that also turns prefix caching off would start it."""
    log = tmp_path_factory.mktemp("real-vllm-logs") / "fp8-no-prefix-caching.log"
    server = start_server((*FP8_ARGS, "--no-enable-prefix-caching"), cpu_vllm_model, free_port(), log)
    try:
        REAL_VLLM_STARTUP_SECONDS["parity FP8 server without prefix caching"] = server.wait_ready()
        yield server
    finally:
        server.stop()


def _sides(canary: RealVllmServer, baseline: RealVllmServer) -> Sides:
    return Sides(
        SideSelector("canary", NAMESPACE, endpoints=(canary.url,)),
        SideSelector("baseline", NAMESPACE, endpoints=(baseline.url,)),
        POLICY.spec.gates.latency.window_seconds,
    )


async def test_a_canary_differing_only_in_the_kv_cache_is_verified(real_vllm: RealPair) -> None:
    async with ScrapeProvider() as provider:
        verdict = await CANARY_CONFIG.evaluate(provider, POLICY, _sides(real_vllm.fp8, real_vllm.bf16))
    assert verdict.kind is GateVerdict.PASS, verdict.message
    assert verdict.reason == "ServedAsPlanned"


async def test_a_canary_with_prefix_caching_off_is_a_mismatch_naming_it(
    real_vllm: RealPair, no_prefix_caching: RealVllmServer
) -> None:
    async with ScrapeProvider() as provider:
        verdict = await CANARY_CONFIG.evaluate(provider, POLICY, _sides(no_prefix_caching, real_vllm.bf16))
    assert verdict.kind is GateVerdict.BREACH and verdict.reason == "CanaryConfigMismatch"
    assert "enable_prefix_caching is False on the canary, True on the target" in verdict.message
    assert "num_gpu_blocks" not in verdict.message and "engine" not in verdict.message


async def test_a_real_servers_version_is_in_the_tables_032_row(real_vllm: RealPair) -> None:
    """What `/version` of real vLLM 0.32 says is a version the planner's table has a row for."""
    async with aiohttp.ClientSession() as session, session.get(f"{real_vllm.bf16.url}/version") as response:
        said = (await response.json())["version"]
    row = release(parse_version(said))
    assert row is not None and row.versions.describe() == "0.32.x", said
