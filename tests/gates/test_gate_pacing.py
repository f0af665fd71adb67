"""gates.accuracy.baselineRequestsPerMinute (issue 23 item 7): the accuracy gate's prompts to the production pods
behind the baseline Service keep the policy's pace, evenly spaced; the canary's are not held back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp import web
from gate_fakes import MODEL, answer_correctly, fake_vllm, run_gate
from kvpolicy.gate_programs.pacing import Pacer


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_a_burst_leaves_evenly_spaced_and_a_late_request_does_not_wait() -> None:
    fake = FakeTime()
    pacer = Pacer(30, clock=fake.clock, sleep=fake.sleep)  # one every 2 s

    async def burst() -> None:
        await asyncio.gather(*(pacer.wait() for _ in range(4)))

    asyncio.run(burst())
    assert fake.slept == [2.0, 4.0, 6.0], "the first goes at once, the others one spacing apart"
    fake.now += 60.0  # long after the last turn
    asyncio.run(pacer.wait())
    assert fake.slept == [2.0, 4.0, 6.0]


def test_a_rate_below_one_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--baseline-requests-per-minute must be at least 1"):
        Pacer(0)


def test_the_gate_paces_the_baseline_and_not_the_canary(tmp_path: Path) -> None:
    """The gate process against two fake servers: at 600 a minute, baseline prompts leave 0.1 s apart."""
    arrivals: dict[str, list[float]] = {"canary": [], "baseline": []}

    def recording(side: str):  # type: ignore[no-untyped-def]
        async def handler(request: web.Request) -> web.StreamResponse:
            arrivals[side].append(time.monotonic())
            return await answer_correctly(request)

        return handler

    async def run() -> tuple[int, dict]:
        async with fake_vllm(recording("canary")) as canary, fake_vllm(recording("baseline")) as baseline:
            return await asyncio.to_thread(
                run_gate,
                "accuracy",
                canary,
                baseline,
                tmp_path,
                *("--model", MODEL, "--length", "2000", "--max-samples", "3", "--min-samples", "3"),
                *("--min-recovery", "0.5", "--baseline-requests-per-minute", "600"),
            )

    _, result = asyncio.run(run())
    assert result["samples"] >= 1, result
    baseline, canary = arrivals["baseline"], arrivals["canary"]
    assert len(baseline) == len(canary) >= 8
    # A lower bound only (a loaded machine makes it later, never earlier): the sends are 0.1 s apart at least, the
    # arrivals as well but for the first's and the last's network jitter.
    assert baseline[-1] - baseline[0] >= (len(baseline) - 1) * 0.1 - 0.05


def test_a_rate_the_crd_refuses_is_refused_by_the_gate_too(tmp_path: Path) -> None:
    code, _ = run_gate_usage(tmp_path, "--baseline-requests-per-minute", "0")
    assert code == 64  # EX_USAGE, as for every flag the CRD refuses


def run_gate_usage(tmp_path: Path, *extra: str) -> tuple[int, str]:
    import subprocess
    import sys

    from gate_fakes import CHILD_ENV

    completed = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "gate", "accuracy", "--canary", "http://a", "--baseline", "http://b",
         "--model", "m", "--length", "10", *extra],
        capture_output=True, text=True, env=CHILD_ENV, timeout=60, check=False,
    )  # fmt: skip
    assert "baselineRequestsPerMinute" in completed.stderr or "baseline-requests-per-minute" in completed.stderr
    assert "Traceback" not in completed.stderr
    return completed.returncode, completed.stderr
