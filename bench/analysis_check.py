"""How long one latency-analysis check takes: both sides read from a real Prometheus (11 instant queries per side) or
scraped from the pods directly, then assessed.

Starts the same processes as the real-Prometheus tests (kvpolicy sim pods and Debian's prometheus on loopback), so it
needs `prometheus` installed. Usage: .venv/bin/python bench/analysis_check.py [--checks N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "analysis"))

from kvpolicy.analysis.latency_check import run_check
from kvpolicy.analysis.model import LatencyGateConfig, SideSelector, Verdict
from kvpolicy.analysis.prometheus import PrometheusProvider
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.api.v1alpha1 import VerdictKind
from live_fleet import Fleet


async def timed(checks: int, check: Callable[[], Awaitable[Verdict]]) -> list[float]:
    await check()  # warm: opens the HTTP session
    durations = []
    for _ in range(checks):
        start = time.perf_counter()
        verdict = await check()
        durations.append((time.perf_counter() - start) * 1000)
        assert verdict.kind is VerdictKind.PASS, verdict
    return durations


def summary(name: str, durations: list[float]) -> str:
    quantiles = statistics.quantiles(durations, n=20)
    return f"| {name} | {len(durations)} | {statistics.median(durations):.1f} | {quantiles[18]:.1f} |"


async def measure(fleet: Fleet, checks: int) -> list[str]:
    config = LatencyGateConfig(window_seconds=600, min_requests=20, bake_seconds=0)
    canary = fleet.pods["m-canary-0"]
    baseline = fleet.pods["m-baseline-0"]
    rows = []
    async with PrometheusProvider(fleet.prometheus.url) as prometheus:
        sides = SideSelector("canary", "llm", pods=(canary.pod,)), SideSelector("baseline", "llm", pods=(baseline.pod,))
        rows.append(summary("Prometheus", await timed(checks, lambda: run_check(prometheus, config, *sides))))
    async with ScrapeProvider() as scrape:
        sides = (
            SideSelector("canary", "llm", endpoints=(canary.url,)),
            SideSelector("baseline", "llm", endpoints=(baseline.url,)),
        )
        await run_check(scrape, config, *sides)  # the first scrape of each pod is the baseline of the next
        await fleet.load([canary.pod, baseline.pod], 30)
        rows.append(summary("direct scrape", await timed(checks, lambda: run_check(scrape, config, *sides))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checks", type=int, default=200)
    args = parser.parse_args()
    fleet = Fleet.start()
    try:
        rows = asyncio.run(measure(fleet, args.checks))
    finally:
        fleet.stop()
    print("| provider | checks | median ms | p95 ms |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
