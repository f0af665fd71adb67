"""The TTFT/ITL latency check: read both sides from a provider over the same window and assess them."""

from __future__ import annotations

import asyncio

from kvpolicy.analysis.model import LatencyGateConfig, ProviderUnavailableError, SideMetrics, SideSelector, Verdict
from kvpolicy.analysis.provider import MetricsProvider
from kvpolicy.analysis.verdicts import assess


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
