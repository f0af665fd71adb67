"""The metrics-provider interface every check reads through, and what a provider answers.

A leaf (it imports only the data models), so the checks, the providers and the rollout core can all name it without
importing one another. A provider that can evaluate PromQL offers it through `promql()`; a check that needs queries
asks for that capability instead of asking which provider it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpolicy.analysis.model import ProviderUnavailableError, SideMetrics, SideSelector
from kvpolicy.api.v1alpha1 import KVPolicyStatus


@dataclass(frozen=True)
class ServedConfig:
    kv_cache_dtype: str  # the server's --kv-cache-dtype: "auto", "fp8", ...
    skip_layers: tuple[str, ...]  # its --kv-cache-dtype-skip-layers
    # Every label of its vllm:cache_config_info sample (one per CacheConfig field), for the parity check.
    labels: Mapping[str, str] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        return f"KV cache dtype {self.kv_cache_dtype}, skip layers [{', '.join(self.skip_layers)}]"

    def same_kv_cache(self, other: ServedConfig) -> bool:
        return self.kv_cache_dtype == other.kv_cache_dtype and set(self.skip_layers) == set(other.skip_layers)

    def record(self, status: KVPolicyStatus) -> None:
        """Show in status.canary what the canary serves."""
        if status.canary is not None:
            status.canary = status.canary.model_copy(
                update={"served_kv_cache_dtype": self.kv_cache_dtype, "served_skip_layers": list(self.skip_layers)}
            )


@dataclass(frozen=True)
class ServedReading:
    """One reading of a side's served configuration: one per pod when every pod published it, else `missing` says
    why not (no series yet, or the provider could not answer)."""

    configs: tuple[ServedConfig, ...] = ()
    missing: str | None = None


class QueryRejectedError(ProviderUnavailableError):
    """The query engine answered, but refused the query itself (bad_data, a non-vector result): the query needs
    fixing."""


class PromQL(Protocol):
    """Instant PromQL queries over the series of both sides."""

    def matchers(self, side: SideSelector) -> str:
        """The label matchers (without braces) that select one side's series."""
        ...

    async def query(self, promql: str) -> list[float]:
        """One value per series of the resulting vector; raise QueryRejectedError for a refused query."""
        ...


class MetricsProvider(Protocol):
    """A source of per-side latency over a window (Prometheus, or the pods' own /metrics)."""

    async def latency_snapshot(
        self, side: SideSelector, window_seconds: float, quantiles: Sequence[float]
    ) -> SideMetrics:
        """Raise ProviderUnavailableError when the source cannot answer; report missing data in the result."""
        ...

    async def served(self, side: SideSelector) -> ServedReading:
        """What each pod of a side serves (vllm:cache_config_info); raise ProviderUnavailableError like above."""
        ...

    def promql(self) -> PromQL | None:
        """The provider's PromQL queries, or None when it cannot evaluate PromQL (the pods' own /metrics)."""
        ...

    async def close(self) -> None: ...
