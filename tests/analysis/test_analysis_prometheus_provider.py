"""The Prometheus provider's queries and its failure handling, against a fake Prometheus HTTP API.

Its answers from a real Prometheus are tested in test_analysis_real_prometheus.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from kvpolicy.analysis.latency_check import run_check
from kvpolicy.analysis.model import LatencyGateConfig, ProviderUnavailableError, SideSelector
from kvpolicy.analysis.prometheus import PrometheusProvider, render_selector
from kvpolicy.api.v1alpha1 import GateVerdict
from live_fleet import free_port  # a port nothing listens on

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def fake_prometheus() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/api/v1/query", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


CANARY = SideSelector("canary", "llm", pods=("m-canary-7d9f.1", "m-canary-x2"))


def test_default_selector_matches_namespace_and_exact_pods() -> None:
    matchers = render_selector('namespace="$namespace", pod=~"$pod_regex"', CANARY)
    assert matchers == 'namespace="llm", pod=~"m\\\\-canary\\\\-7d9f\\\\.1|m\\\\-canary\\\\-x2"'


def test_selector_template_with_pod_labels() -> None:
    side = SideSelector("baseline", 'odd"ns', pods=("p",), labels={"app.kubernetes.io/name": "m", "tier": "serve"})
    matchers = render_selector('kubernetes_namespace="$namespace", $labels, role="$role"', side)
    assert matchers == 'kubernetes_namespace="odd\\"ns", app_kubernetes_io_name="m", tier="serve", role="baseline"'


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_url": "prometheus:9090"}, "must start with http"),
        ({"base_url": "http://p", "timeout_seconds": 0}, "timeout must be above 0"),
        ({"base_url": "http://p", "selector_template": 'ns="$ns"'}, r"unknown: \['ns'\]"),
        ({"base_url": "http://p", "selector_template": 'pod="$"'}, "selector template"),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrometheusProvider(**kwargs)


async def test_queries_and_answers(fake_prometheus: Callable[[Handler], Awaitable[str]]) -> None:
    queries: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        query = (await request.post())["query"]
        assert isinstance(query, str)
        queries.append(query)
        if "inter_token_latency_seconds" in query:
            result: list[dict[str, Any]] = []  # an old vLLM: no ITL series
        elif query.startswith("count by (le)"):
            bounds = ("0.01", "0.025", "+Inf") if "time_per_output_token" in query else ("0.5", "1", "+Inf")
            result = [{"metric": {"le": le}, "value": [1, "2"]} for le in bounds]
        elif "_sum" in query:
            result = [{"metric": {}, "value": [1, "0.017" if "time_per_output_token" in query else "0.41"]}]
        elif "time_per_output_token_seconds" in query:
            result = [{"metric": {}, "value": [1, "0.02"]}]
        elif query.startswith("histogram_quantile"):
            result = [{"metric": {}, "value": [1, "0.5" if "(0.5," in query else "NaN"]}]
        elif "request_success_total" in query and "finished_reason" not in query:
            result = [{"metric": {}, "value": [1, "97"]}]  # the finished requests
        elif "request_success_total" in query:
            result = [{"metric": {}, "value": [1, "0.01"]}]
        elif "http_requests_total" in query:
            result = [{"metric": {}, "value": [1, "NaN"]}]  # nothing served over HTTP: 0/0
        elif "kv_cache_usage_perc" in query:
            result = [{"metric": {}, "value": [1, "0.3"]}]
        elif query.startswith("count("):
            result = [{"metric": {}, "value": [1, "31"]}]
        else:
            result = [{"metric": {}, "value": [1, "120.4"]}]
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})

    url = await fake_prometheus(answer)
    async with PrometheusProvider(url) as provider:
        metrics = await provider.latency_snapshot(CANARY, 300, (0.5, 0.95))
    assert metrics.series_found and metrics.requests == pytest.approx(120.4)
    assert metrics.ttft_seconds == {0.5: 0.5, 0.95: None}
    assert metrics.itl_seconds == {0.5: 0.02, 0.95: 0.02}
    assert metrics.itl_metric == "time_per_output_token_seconds"
    assert (metrics.ttft_mean_seconds, metrics.itl_mean_seconds) == (0.41, 0.017)
    assert metrics.ttft_bucket_bounds == (0.5, 1.0, math.inf)
    assert metrics.itl_bucket_bounds == (0.01, 0.025, math.inf)
    assert (metrics.error_ratio, metrics.http_error_ratio, metrics.kv_cache_usage) == (0.01, None, 0.3)
    selector = 'namespace="llm", pod=~"m\\\\-canary\\\\-7d9f\\\\.1|m\\\\-canary\\\\-x2"'
    ttft = (
        f'histogram_quantile(0.95, sum by (le) (rate({{__name__=~"vllm[:_]time_to_first_token_seconds_bucket", '
        f"{selector}}}[300000ms])))"
    )
    assert ttft in queries
    assert f'sum(increase({{__name__=~"vllm[:_]time_to_first_token_seconds_count", {selector}}}[300000ms]))' in queries
    assert f'count({{__name__=~"vllm[:_].+", {selector}}})' in queries
    # The mean reads both prefix spellings, and the deprecated ITL name where ITL is missing.
    for metric in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        total = f'{{__name__=~"vllm[:_]{metric}_sum", {selector}}}'
        count = f'{{__name__=~"vllm[:_]{metric}_count", {selector}}}'
        assert f"sum(rate({total}[300000ms])) / sum(rate({count}[300000ms]))" in queries
        assert f'count by (le) ({{__name__=~"vllm[:_]{metric}_bucket", {selector}}})' in queries
    # The finished requests (the side's share of the traffic): every ending, both prefix spellings.
    assert f'sum(increase({{__name__=~"vllm[:_]request_success_total", {selector}}}[300000ms]))' in queries
    assert metrics.finished_requests == 97
    # Per histogram (TTFT, ITL, deprecated ITL): two quantiles, the mean, the bounds; and six scalars.
    assert len(queries) == 3 * 4 + 6


async def test_a_side_without_pods_asks_nothing() -> None:
    async with PrometheusProvider(f"http://127.0.0.1:{free_port()}") as provider:
        metrics = await provider.latency_snapshot(SideSelector("canary", "llm"), 60, (0.5,))
    assert not metrics.series_found and metrics.requests == 0


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(1.5)
    return web.json_response({})


def respond(status: int, body: Any) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    return handler


# Whatever an endpoint answers, only the status code, its standard phrase and Prometheus' own error type (a fixed
# vocabulary) reach the message: status and events are world-readable, and prometheusURL may point anywhere.
@pytest.mark.parametrize(
    ("handler", "reason", "message", "withheld"),
    [
        (
            respond(503, {"status": "error", "errorType": "unavailable", "error": "secret-ish detail"}),
            "PrometheusServerError",
            "answered HTTP 503 Service Unavailable",
            "secret-ish detail",
        ),
        (respond(500, "oops, internal dump"), "PrometheusServerError", "HTTP 500 Internal Server Error", "oops"),
        (
            respond(400, {"status": "error", "errorType": "bad_data", "error": "parse error at char 7"}),
            "QueryRejected",
            "rejected 'up' (HTTP 400 Bad Request, bad_data)",
            "parse error",
        ),
        (
            respond(422, {"status": "error", "errorType": "execution", "error": "many-to-many"}),
            "QueryRejected",
            "(HTTP 422 Unprocessable Entity, execution)",
            "many-to-many",
        ),
        (
            respond(400, {"status": "error", "errorType": "<b>admin password: hunter2</b>", "error": "x"}),
            "QueryRejected",
            "(HTTP 400 Bad Request)",
            "hunter2",
        ),
        (respond(200, "<html>login page of an internal app</html>"), "QueryRejected", "(HTTP 200 OK)", "login"),
        (respond(401, "who are you, token abc?"), "PrometheusUnauthorized", "HTTP 401 Unauthorized", "token abc"),
        (
            respond(200, {"status": "success", "data": {"resultType": "matrix", "result": []}}),
            "QueryRejected",
            "answered 'up' with something else than a vector",
            "matrix",
        ),
        (slow, "PrometheusTimeout", "did not answer within 0.5 s", "{}"),
    ],
)
async def test_failures_say_the_status_never_the_body(
    fake_prometheus: Callable[[Handler], Awaitable[str]],
    handler: Handler,
    reason: str,
    message: str,
    withheld: str,
) -> None:
    url = await fake_prometheus(handler)
    async with PrometheusProvider(url, timeout_seconds=0.5) as provider:
        with pytest.raises(ProviderUnavailableError) as raised:
            await provider.query("up")
    assert raised.value.reason == reason
    assert message in raised.value.message
    assert withheld not in raised.value.message


async def test_credentials_in_the_url_never_reach_a_message() -> None:
    url = f"http://admin:hunter2@127.0.0.1:{free_port()}"
    async with PrometheusProvider(url) as provider:
        with pytest.raises(ProviderUnavailableError) as raised:
            await provider.query("up")
    assert "hunter2" not in raised.value.message and "admin" not in raised.value.message
    assert f"http://127.0.0.1:{url.rsplit(':', 1)[1]}" in raised.value.message


async def test_unreachable_prometheus_is_a_provider_unavailable_verdict() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    baseline = SideSelector("baseline", "llm", pods=("m-0",))
    async with PrometheusProvider(url) as provider:
        verdict = await run_check(provider, LatencyGateConfig(), CANARY, baseline)
    assert (verdict.kind, verdict.reason) == (GateVerdict.PROVIDER_UNAVAILABLE, "PrometheusUnreachable")
    assert url in verdict.message
