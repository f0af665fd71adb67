"""Constants and small types shared by the real-vLLM tests."""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy_dev.devcluster.cpu_vllm import RealVllmServer

SERVED_MODEL = "tiny"
# The test Prometheus (conftest `prometheus`) scrapes the session's servers as these pods of this namespace.
NAMESPACE = "llm"
CANARY_POD = "tiny-fp8-0"
BASELINE_POD = "tiny-bf16-0"
MAX_MODEL_LEN = 8192
BF16_ARGS = (SERVED_MODEL, "--max-model-len", str(MAX_MODEL_LEN))
SKIP_LAYERS = ("sliding_window", "0")
FP8_ARGS = (
    *BF16_ARGS,
    "--kv-cache-dtype",
    "fp8",
    "--kv-cache-dtype-skip-layers",
    *SKIP_LAYERS,
    "--attention-backend",
    "FLASH_ATTN",
)


@dataclass(frozen=True)
class RealPair:
    bf16: RealVllmServer
    fp8: RealVllmServer


@dataclass(frozen=True)
class ScrapeTarget:
    """A scrape target for the test Prometheus: the server's port, under a pod name."""

    pod: str
    port: int
