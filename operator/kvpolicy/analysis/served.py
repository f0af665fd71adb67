"""What a vLLM server really serves, from its own `vllm:cache_config_info`: the KV cache dtype and skip layers it
runs, whatever its pod spec asked for (an image whose entrypoint drops arguments serves something else)."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CACHE_CONFIG = "cache_config_info"  # without the vllm prefix (names.strip_vllm_prefix)


@dataclass(frozen=True)
class ServedConfig:
    kv_cache_dtype: str  # the server's --kv-cache-dtype: "auto", "fp8", ...
    skip_layers: tuple[str, ...]  # its --kv-cache-dtype-skip-layers

    def describe(self) -> str:
        return f"KV cache dtype {self.kv_cache_dtype}, skip layers [{', '.join(self.skip_layers)}]"


@dataclass(frozen=True)
class ServedReading:
    """One reading of a side's served configuration: one per pod when every pod published it, else `missing` says
    why not (no series yet, or the provider could not answer)."""

    configs: tuple[ServedConfig, ...] = ()
    missing: str | None = None
    reason: str | None = None  # a provider that could not answer: its ProviderUnavailableError's reason


def served_config(labels: Mapping[str, str]) -> ServedConfig:
    """A cache_config_info sample's labels: `cache_dtype="fp8"`, `kv_cache_dtype_skip_layers="['0', '31']"`."""
    text = labels.get("kv_cache_dtype_skip_layers", "[]")
    try:
        layers = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        layers = [text]
    if not isinstance(layers, list | tuple):
        layers = [layers]
    return ServedConfig(kv_cache_dtype=labels.get("cache_dtype", ""), skip_layers=tuple(str(layer) for layer in layers))


def reading(found: Sequence[ServedConfig | None], where: str) -> ServedReading:
    """All pods' configurations, or what is missing when a pod (or every pod) published none."""
    if not found:
        return ServedReading(missing=f"no ready pod to read at {where}")
    configs = tuple(config for config in found if config is not None)
    if len(configs) < len(found):
        return ServedReading(missing=f"{len(found) - len(configs)} pod(s) publish no vllm:{CACHE_CONFIG} at {where}")
    return ServedReading(configs=configs)
