"""The analysis against a real Prometheus (Debian's binary) scraping vLLM-like server processes every 200 ms.

Each verdict is produced for real: Pass (equal pods), Breach (a canary 1.5x slower, and a canary whose decode is 1.3x
slower but still inside vLLM's first ITL bucket), NoData (a canary without traffic, and a canary Prometheus has never
seen), ProviderUnavailable (Prometheus stopped in the middle of an analysis).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from kvpolicy.analysis.latency_check import run_check
from kvpolicy.analysis.model import Action, AnalysisState, LatencyGateConfig, SideSelector, Verdict
from kvpolicy.analysis.prometheus import PrometheusProvider
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.analysis.verdicts import next_analysis_state
from kvpolicy.api.v1alpha1 import GateVerdict
from live_fleet import LOADED_REQUESTS, Fleet, PrometheusServer, drive_load

pytestmark = pytest.mark.prometheus

# A window long enough to hold everything the session's Prometheus has seen.
CONFIG = LatencyGateConfig(
    ttft_max_ratio=1.2, itl_max_ratio=1.2, window_seconds=600, min_requests=20, bake_seconds=0, interval_seconds=1
)


def pods(role: str, *names: str) -> SideSelector:
    return SideSelector(role, "llm", pods=names)


BASELINE = pods("baseline", "m-baseline-0")


async def check(fleet: Fleet, canary: str, config: LatencyGateConfig = CONFIG) -> tuple[GateVerdict, str, Verdict]:
    async with PrometheusProvider(fleet.prometheus.url) as provider:
        verdict = await run_check(provider, config, pods("canary", canary), BASELINE)
    return verdict.kind, verdict.reason, verdict


async def test_pass(fleet: Fleet) -> None:
    kind, reason, verdict = await check(fleet, "m-canary-0")
    assert (kind, reason) == (GateVerdict.PASS, "WithinThresholds"), verdict
    # increase() extrapolates towards the window's edges, so it never counts fewer requests than were served.
    assert verdict.canary is not None and LOADED_REQUESTS <= verdict.canary.requests < 2 * LOADED_REQUESTS
    for metric, quantile in [("ttft", 0.5), ("ttft", 0.95), ("itl", 0.5), ("itl", 0.95)]:
        assert verdict.ratio(metric, quantile) == pytest.approx(1.0)
    # Equal pods put both sides' estimates in the same buckets, so the means decided, and they are equal too.
    assert verdict.mean_ratio("ttft") == pytest.approx(1.0, rel=0.02)
    assert verdict.mean_ratio("itl") == pytest.approx(1.0, rel=0.02)
    assert "TTFT p50 and p95 fall in one bucket (40-60 ms) on both sides; compared means" in verdict.message
    assert "ITL p50 and p95 fall in one bucket (<= 10 ms) on both sides; compared means" in verdict.message


async def test_breach(fleet: Fleet) -> None:
    kind, reason, verdict = await check(fleet, "m-slow-0")
    # ITL (~10 ms vs ~7 ms) straddles vLLM's first ITL bucket bound (10 ms): where a quantile resolves it breaches,
    # where it does not the means (1.5x) do, so both metrics breach.
    assert (kind, reason) == (GateVerdict.BREACH, "LatencyRatioExceeded"), verdict
    # ~73 ms vs ~48 ms TTFT land in the (60, 80] and (40, 60] ms buckets: the medians interpolate to 70 and 50 ms.
    assert verdict.ratio("ttft", 0.5) == pytest.approx(0.07 / 0.05)


async def test_decode_regression_inside_the_first_itl_bucket(fleet: Fleet) -> None:
    # The ITL gate alone: the canary decodes 1.3x slower, ~8.6 ms against ~6.6 ms per token.
    itl_only = replace(CONFIG, ttft_max_ratio=None)
    kind, reason, verdict = await check(fleet, "m-decode-slow-0", itl_only)
    # What the quantiles see: both sides' p50 and p95 interpolate to 5 and 9.5 ms, a ratio of 1.00, which used to
    # pass. They are unresolved now, and the means catch the regression.
    assert verdict.ratio("itl", 0.5) == pytest.approx(1.0) and verdict.ratio("itl", 0.95) == pytest.approx(1.0)
    assert all(not check.resolved and check.shared_bucket == (0.0, 0.01) for check in verdict.checks)
    assert (kind, reason) == (GateVerdict.BREACH, "ITLRatioExceeded"), verdict.message
    assert verdict.mean_ratio("itl") == pytest.approx(1.3, rel=0.03)
    assert verdict.message.startswith("ITL p50 and p95 fall in one bucket (<= 10 ms) on both sides; compared means:")


async def test_no_data_without_traffic(fleet: Fleet) -> None:
    kind, reason, verdict = await check(fleet, "m-idle-0")
    assert (kind, reason) == (GateVerdict.NO_DATA, "TooFewCanaryRequests"), verdict
    assert verdict.canary is not None and verdict.canary.series_found
    assert verdict.canary.ttft_mean_seconds is None and verdict.canary.itl_mean_seconds is None


async def test_no_data_for_pods_prometheus_does_not_scrape(fleet: Fleet) -> None:
    kind, reason, verdict = await check(fleet, "m-canary-that-never-started")
    assert (kind, reason) == (GateVerdict.NO_DATA, "NoCanarySeries"), verdict


async def test_vllm_underscore_prefix_and_deprecated_itl(fleet: Fleet) -> None:
    kind, _, verdict = await check(fleet, "m-underscore-0")
    assert kind is GateVerdict.PASS, verdict
    assert verdict.canary is not None and verdict.baseline is not None
    assert verdict.canary.itl_metric == "time_per_output_token_seconds"
    assert verdict.baseline.itl_metric == "inter_token_latency_seconds"
    assert verdict.ratio("itl", 0.95) == pytest.approx(1.0)
    # The fake pod's ITL is fixed at 6.6 ms: its mean, read under the `vllm_` prefix and the deprecated name, is exact.
    assert verdict.canary.itl_mean_seconds == pytest.approx(0.0066)
    assert verdict.canary.itl_bucket_bounds[0] == 0.01


async def test_error_ratio_and_kv_cache_usage(fleet: Fleet) -> None:
    async with PrometheusProvider(fleet.prometheus.url) as provider:
        simulated = await provider.latency_snapshot(BASELINE, 600, (0.5,))
        fake = await provider.latency_snapshot(pods("canary", "m-underscore-0"), 600, (0.5,))
    assert simulated.error_ratio == 0.0
    assert simulated.http_error_ratio == 0.0  # the simulator counts HTTP requests by status class, as vLLM does
    assert simulated.kv_cache_usage is not None and 0 <= simulated.kv_cache_usage < 1
    assert (fake.error_ratio, fake.http_error_ratio, fake.kv_cache_usage) == (0.0, 0.0, 0.25)


async def test_scrape_provider_agrees_with_prometheus(fleet: Fleet) -> None:
    # The fake pod's latencies are fixed, so any window of it has the same quantiles.
    pod = fleet.pods["m-underscore-0"]
    scraped_side = SideSelector("canary", "llm", endpoints=(pod.url,))
    async with ScrapeProvider() as scrape, PrometheusProvider(fleet.prometheus.url) as prometheus:
        await scrape.latency_snapshot(scraped_side, 600, CONFIG.quantiles)
        await drive_load(pod.url, 30)
        scraped = await scrape.latency_snapshot(scraped_side, 600, CONFIG.quantiles)
        queried = await prometheus.latency_snapshot(pods("canary", pod.pod), 600, CONFIG.quantiles)
    assert scraped.requests == 30
    assert scraped.ttft_seconds == pytest.approx(queried.ttft_seconds)
    assert scraped.itl_seconds == pytest.approx(queried.itl_seconds)
    assert (scraped.ttft_mean_seconds, scraped.itl_mean_seconds) == (pytest.approx(0.048), pytest.approx(0.0066))
    assert (queried.ttft_mean_seconds, queried.itl_mean_seconds) == (pytest.approx(0.048), pytest.approx(0.0066))
    assert (scraped.ttft_bucket_bounds, scraped.itl_bucket_bounds) == (
        queried.ttft_bucket_bounds,
        queried.itl_bucket_bounds,
    )


async def test_prometheus_stopped_mid_analysis(fleet: Fleet) -> None:
    canary, baseline = fleet.pods["m-canary-0"], fleet.pods["m-baseline-0"]
    prometheus = PrometheusServer([canary, baseline])
    try:
        await fleet.load([canary.pod, baseline.pod], 30, prometheus)
        config = LatencyGateConfig(window_seconds=600, min_requests=20, bake_seconds=60, interval_seconds=1)
        now = datetime.now(UTC)
        state = AnalysisState.start(now)
        async with PrometheusProvider(prometheus.url, timeout_seconds=2) as provider:
            first = await run_check(provider, config, pods("canary", canary.pod), BASELINE)
            state, outcome = next_analysis_state(config, state, first, now + timedelta(seconds=1))
            assert (first.kind, outcome.action) == (GateVerdict.PASS, Action.CONTINUE), first
            prometheus.stop()
            second = await run_check(provider, config, pods("canary", canary.pod), BASELINE)
            state, outcome = next_analysis_state(config, state, second, now + timedelta(seconds=2))
    finally:
        prometheus.stop()
    assert (second.kind, second.reason) == (GateVerdict.PROVIDER_UNAVAILABLE, "PrometheusUnreachable")
    assert (outcome.action, outcome.reason) == (Action.CONTINUE, "PrometheusUnreachable")
    assert state.passes == 1 and state.inconclusive == 1 and state.inconclusive_since is not None
