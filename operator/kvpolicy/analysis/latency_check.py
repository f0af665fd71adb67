"""One analysis check: read both sides from a provider and assess them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvpolicy.analysis.model import LatencyGateConfig, ProviderUnavailableError, SideMetrics, SideSelector, Verdict
from kvpolicy.analysis.verdicts import assess

if TYPE_CHECKING:  # served.py defines a check on this protocol
    from kvpolicy.analysis.served import ServedReading


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

    async def close(self) -> None: ...


async def run_check(
    provider: MetricsProvider, config: LatencyGateConfig, canary: SideSelector, baseline: SideSelector
) -> Verdict:
    """Measure both sides over the same window and judge the canary; never raises for an unavailable provider."""
    try:
        canary_metrics, baseline_metrics = await latency_snapshots(provider, config, canary, baseline)
    except ProviderUnavailableError as error:
        return Verdict.provider_unavailable(error)
    return assess(config, canary_metrics, baseline_metrics)


async def latency_snapshots(
    provider: MetricsProvider, config: LatencyGateConfig, canary: SideSelector, baseline: SideSelector
) -> tuple[SideMetrics, SideMetrics]:
    """Both sides' latency over the same window; raises ProviderUnavailableError."""
    canary_metrics, baseline_metrics = await asyncio.gather(
        provider.latency_snapshot(canary, config.window_seconds, config.quantiles),
        provider.latency_snapshot(baseline, config.window_seconds, config.quantiles),
    )
    return canary_metrics, baseline_metrics
