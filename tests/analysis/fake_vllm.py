"""A minimal vLLM stand-in for the analysis tests: /metrics in vLLM's names (prefix and ITL name configurable, which
the real simulator does not offer) and a streaming /v1/completions that records fixed latencies.

Run as a process (`python fake_vllm.py --port P ...`) so Prometheus can scrape it while tests block, or use
`VLLMMetrics` in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)


class VLLMMetrics:
    """vLLM's latency histograms, finish-reason counter, KV cache gauge and the API server's HTTP counter."""

    def __init__(self, prefix: str = "vllm:", itl_name: str = "inter_token_latency_seconds") -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.ttft = Histogram(
            f"{prefix}time_to_first_token_seconds", "TTFT", labels, buckets=TTFT_BUCKETS, registry=self.registry
        )
        self.itl = Histogram(f"{prefix}{itl_name}", "ITL", labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.finished = Counter(
            f"{prefix}request_success", "Finished requests", [*labels, "finished_reason"], registry=self.registry
        )
        self.kv_cache_usage = Gauge(f"{prefix}kv_cache_usage_perc", "KV cache usage", labels, registry=self.registry)
        self.http = Counter("http_requests", "HTTP requests", ["handler", "method", "status"], registry=self.registry)
        # vLLM creates its series at start-up, at 0: Prometheus' increase() cannot see a series' first value.
        self.ttft.labels("m", "0")
        self.itl.labels("m", "0")
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels("m", "0", reason)
        self.kv_cache_usage.labels("m", "0").set(0.25)
        # The API server creates this series on its first request; creating it now keeps the tests' ratios defined.
        self.http.labels("/v1/completions", "POST", "2xx")

    def record(
        self, ttft: float, itl: float, tokens: int = 4, finished_reason: str = "stop", status: str = "2xx"
    ) -> None:
        self.ttft.labels("m", "0").observe(ttft)
        for _ in range(tokens - 1):
            self.itl.labels("m", "0").observe(itl)
        self.finished.labels("m", "0", finished_reason).inc()
        self.http.labels("/v1/completions", "POST", status).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def make_app(metrics: VLLMMetrics, ttft: float, itl: float, time_scale: float) -> web.Application:
    async def serve_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), content_type="text/plain")

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tokens = int(body.get("max_tokens", 4))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(ttft * time_scale)
        for index in range(tokens):
            if index:
                await asyncio.sleep(itl * time_scale)
            chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        metrics.record(ttft, itl, tokens)
        return response

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    app.router.add_post("/v1/completions", complete)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefix", default="vllm:")
    parser.add_argument("--itl-name", default="inter_token_latency_seconds")
    parser.add_argument("--ttft", type=float, default=0.05, help="simulated TTFT, seconds")
    parser.add_argument("--itl", type=float, default=0.02, help="simulated ITL, seconds")
    parser.add_argument("--time-scale", type=float, default=0.01, help="real sleep per simulated second")
    args = parser.parse_args()
    metrics = VLLMMetrics(args.prefix, args.itl_name)
    web.run_app(make_app(metrics, args.ttft, args.itl, args.time_scale), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
