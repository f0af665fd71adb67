"""The scrape provider against in-process fake vLLM servers: bucket deltas over the window, both prefix spellings,
the deprecated ITL name, counter resets, and every failure turned into ProviderUnavailable."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from fake_vllm import ITL_BUCKETS, TTFT_BUCKETS, VLLMMetrics
from kvpolicy.analysis.latency_check import run_check
from kvpolicy.analysis.model import LatencyGateConfig, ProviderUnavailableError, SideSelector
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.api.v1alpha1 import GateVerdict
from live_fleet import free_port  # a port nothing listens on


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakePod:
    """A pod whose /metrics serves `metrics` (replaceable, to emulate a restart) or a canned failure."""

    def __init__(self, metrics: VLLMMetrics) -> None:
        self.metrics = metrics
        self.failure: web.Response | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        if self.failure is not None:
            return self.failure
        return web.Response(body=self.metrics.exposition(), content_type="text/plain")


@pytest.fixture
async def serve_pod() -> AsyncIterator[Callable[[VLLMMetrics], object]]:
    runners: list[web.AppRunner] = []

    async def start(metrics: VLLMMetrics) -> FakePod:
        pod = FakePod(metrics)
        app = web.Application()
        app.router.add_get("/metrics", pod.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        pod.url = f"http://127.0.0.1:{port}"
        return pod

    yield start  # type: ignore[misc]
    for runner in runners:
        await runner.cleanup()


def side(role: str, *pods: FakePod) -> SideSelector:
    return SideSelector(role=role, namespace="llm", endpoints=tuple(pod.url for pod in pods))


QUANTILES = (0.5, 0.95)


def serve(metrics: VLLMMetrics, count: int, ttft: float, itl: float = 0.02, **kwargs: object) -> None:
    for _ in range(count):
        metrics.record(ttft, itl, **kwargs)  # type: ignore[arg-type]


async def test_window_delta_quantiles(serve_pod: Callable[[VLLMMetrics], object]) -> None:
    metrics = VLLMMetrics()
    serve(metrics, 500, ttft=3.0)  # before the window: must not count
    pod = await serve_pod(metrics)  # type: ignore[misc]
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:
        first = await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
        assert first.series_found and first.requests == 0 and first.window_seconds == 0
        assert first.ttft_seconds == {0.5: None, 0.95: None}
        serve(metrics, 40, ttft=0.03, itl=0.03)
        clock.now += 60
        second = await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
    assert second.requests == 40 and second.window_seconds == 60
    # 40 TTFTs in the (0.02, 0.04] bucket: p50 interpolates to its middle, p95 near its top.
    assert second.ttft_seconds[0.5] == pytest.approx(0.03)
    assert second.ttft_seconds[0.95] == pytest.approx(0.039)
    assert second.itl_seconds[0.5] == pytest.approx(0.0375)  # (0.025, 0.05]
    # Means from the _sum and _count deltas: the 500 slow requests before the window do not count.
    assert (second.ttft_mean_seconds, second.itl_mean_seconds) == (pytest.approx(0.03), pytest.approx(0.03))
    assert second.ttft_bucket_bounds == (*TTFT_BUCKETS, math.inf)
    assert second.itl_bucket_bounds == (*ITL_BUCKETS, math.inf)
    assert second.itl_metric == "inter_token_latency_seconds"
    assert second.kv_cache_usage == pytest.approx(0.25)
    assert second.error_ratio == 0.0 and second.http_error_ratio == 0.0


async def test_baseline_scrape_is_one_window_old(serve_pod: Callable[[VLLMMetrics], object]) -> None:
    metrics = VLLMMetrics()
    pod = await serve_pod(metrics)  # type: ignore[misc]
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:
        for served in (7, 11, 13):  # scrapes at t=0, 30, 60, then 90 with a 45 s window: subtract the one at t=30
            await provider.latency_snapshot(side("canary", pod), 45, QUANTILES)
            serve(metrics, served, ttft=0.03)
            clock.now += 30
        snapshot = await provider.latency_snapshot(side("canary", pod), 45, QUANTILES)
    assert snapshot.requests == 11 + 13 and snapshot.window_seconds == 60


async def test_pods_of_a_side_add_up_and_a_restart_counts_from_zero(
    serve_pod: Callable[[VLLMMetrics], object],
) -> None:
    first, second = VLLMMetrics(), VLLMMetrics()
    serve(second, 100, ttft=0.03)
    pods = [await serve_pod(first), await serve_pod(second)]  # type: ignore[misc]
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:
        await provider.latency_snapshot(side("baseline", *pods), 60, QUANTILES)
        serve(first, 10, ttft=0.03)
        pods[1].metrics = VLLMMetrics()  # the second pod restarted: its counters start again
        serve(pods[1].metrics, 5, ttft=0.03)
        clock.now += 60
        snapshot = await provider.latency_snapshot(side("baseline", *pods), 60, QUANTILES)
    assert snapshot.requests == 15
    assert snapshot.ttft_mean_seconds == pytest.approx(0.03)


async def test_error_ratios(serve_pod: Callable[[VLLMMetrics], object]) -> None:
    metrics = VLLMMetrics()
    pod = await serve_pod(metrics)  # type: ignore[misc]
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:
        await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
        serve(metrics, 6, ttft=0.03)
        serve(metrics, 1, ttft=0.03, finished_reason="abort")
        serve(metrics, 1, ttft=0.03, finished_reason="error", status="5xx")
        serve(metrics, 2, ttft=0.03, finished_reason="length")
        clock.now += 60
        snapshot = await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
    assert snapshot.error_ratio == pytest.approx(0.2)
    assert snapshot.http_error_ratio == pytest.approx(0.1)


async def test_deprecated_itl_name(serve_pod: Callable[[VLLMMetrics], object]) -> None:
    metrics = VLLMMetrics(itl_name="time_per_output_token_seconds")
    pod = await serve_pod(metrics)  # type: ignore[misc]
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:
        await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
        serve(metrics, 10, ttft=0.03, itl=0.06)
        clock.now += 60
        snapshot = await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
    assert snapshot.itl_metric == "time_per_output_token_seconds"
    assert snapshot.itl_seconds[0.5] == pytest.approx(0.0625)
    assert snapshot.itl_mean_seconds == pytest.approx(0.06)


async def test_a_pod_without_vllm_metrics_has_no_series(serve_pod: Callable[[VLLMMetrics], object]) -> None:
    pod = await serve_pod(VLLMMetrics())  # type: ignore[misc]
    pod.failure = web.Response(text="# nothing here\nprocess_cpu_seconds_total 1\n")
    async with ScrapeProvider() as provider:
        snapshot = await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
    assert not snapshot.series_found and snapshot.requests == 0


@pytest.mark.parametrize(
    ("failure", "reason", "message"),
    [
        (web.Response(status=503, text="draining"), "ScrapeFailed", "answered HTTP 503 Service Unavailable"),
        (web.Response(text="vllm:time_to_first_token_seconds_bucket{le=oops} 1\n"), "ScrapeUnparseable", "exposition"),
    ],
)
async def test_scrape_failures(
    serve_pod: Callable[[VLLMMetrics], object], failure: web.Response, reason: str, message: str
) -> None:
    pod = await serve_pod(VLLMMetrics())  # type: ignore[misc]
    pod.failure = failure
    async with ScrapeProvider() as provider:
        with pytest.raises(ProviderUnavailableError, match=message) as raised:
            await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
    assert raised.value.reason == reason
    # What the pod sent never reaches the message (it ends up in status and events).
    assert "draining" not in raised.value.message and "oops" not in raised.value.message


async def test_unreachable_pod_makes_the_check_provider_unavailable(
    serve_pod: Callable[[VLLMMetrics], object],
) -> None:
    baseline = await serve_pod(VLLMMetrics())  # type: ignore[misc]
    canary = SideSelector("canary", "llm", endpoints=(f"http://127.0.0.1:{free_port()}",))
    async with ScrapeProvider(timeout_seconds=2) as provider:
        verdict = await run_check(provider, LatencyGateConfig(), canary, side("baseline", baseline))
    assert (verdict.kind, verdict.reason) == (GateVerdict.PROVIDER_UNAVAILABLE, "ScrapeFailed")
    assert "cannot scrape" in verdict.message


async def test_first_check_is_no_data_then_pass_then_breach(serve_pod: Callable[[VLLMMetrics], object]) -> None:
    canary_metrics, baseline_metrics = VLLMMetrics(), VLLMMetrics()
    canary, baseline = await serve_pod(canary_metrics), await serve_pod(baseline_metrics)  # type: ignore[misc]
    config = LatencyGateConfig(window_seconds=60, min_requests=20, ttft_max_ratio=1.2, itl_max_ratio=1.2)
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:

        async def check() -> GateVerdict:
            return (await run_check(provider, config, side("canary", canary), side("baseline", baseline))).kind

        assert await check() is GateVerdict.NO_DATA
        serve(canary_metrics, 30, ttft=0.05, itl=0.02)
        serve(baseline_metrics, 30, ttft=0.05, itl=0.02)
        clock.now += 60
        assert await check() is GateVerdict.PASS
        serve(canary_metrics, 30, ttft=0.09, itl=0.02)
        serve(baseline_metrics, 30, ttft=0.05, itl=0.02)
        clock.now += 60
        assert await check() is GateVerdict.BREACH


@pytest.mark.parametrize("prefix", ["vllm:", "vllm_"])
async def test_itl_regression_below_the_first_bucket_is_a_breach(
    serve_pod: Callable[[VLLMMetrics], object], prefix: str
) -> None:
    canary_metrics, baseline_metrics = VLLMMetrics(prefix), VLLMMetrics(prefix)
    canary, baseline = await serve_pod(canary_metrics), await serve_pod(baseline_metrics)  # type: ignore[misc]
    config = LatencyGateConfig(window_seconds=60, min_requests=20, ttft_max_ratio=1.2, itl_max_ratio=1.2)
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:
        await run_check(provider, config, side("canary", canary), side("baseline", baseline))
        serve(canary_metrics, 30, ttft=0.05, itl=0.0086)  # 1.3x a 6.6 ms decode: all in vLLM's (0, 10 ms] bucket
        serve(baseline_metrics, 30, ttft=0.05, itl=0.0066)
        clock.now += 60
        verdict = await run_check(provider, config, side("canary", canary), side("baseline", baseline))
    assert (verdict.kind, verdict.reason) == (GateVerdict.BREACH, "ITLRatioExceeded"), verdict.message
    assert verdict.ratio("itl", 0.5) == pytest.approx(1.0) and verdict.ratio("itl", 0.95) == pytest.approx(1.0)
    assert verdict.mean_ratio("itl") == pytest.approx(0.0086 / 0.0066)
    assert (
        "ITL p50 and p95 fall in one bucket (<= 10 ms) on both sides; compared means: canary 8.6 ms" in verdict.message
    )


@pytest.mark.parametrize("prefix", ["vllm:", "vllm_"])
async def test_finished_requests_count_every_ending_in_either_spelling(
    serve_pod: Callable[[VLLMMetrics], object], prefix: str
) -> None:
    metrics = VLLMMetrics(prefix=prefix)
    serve(metrics, 30, ttft=0.03)  # before the window
    pod = await serve_pod(metrics)  # type: ignore[misc]
    clock = FakeClock()
    async with ScrapeProvider(clock=clock) as provider:
        first = await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
        assert first.finished_requests is None, "nothing to subtract yet: no share measured"
        serve(metrics, 7, ttft=0.03)
        serve(metrics, 2, ttft=0.03, finished_reason="length")
        serve(metrics, 1, ttft=0.03, finished_reason="abort")
        clock.now += 60
        snapshot = await provider.latency_snapshot(side("canary", pod), 60, QUANTILES)
    assert snapshot.finished_requests == 10
