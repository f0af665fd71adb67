"""The pure step where the world changes under a rollout: a latency analysis that stalls on Hold, and GPU facts that
change after planning (nodes relabelled, labels missing at planning and back later)."""

from __future__ import annotations

from kvpolicy.analysis import VerdictKind
from test_operator_step import live, verdict


def stall_events(reasons: list[str]) -> int:
    return reasons.count("AnalysisStalled")


def test_a_stalled_analysis_on_hold_warns_once_per_stall_while_the_canary_keeps_serving() -> None:
    driver = live(**{"gates.latency.inconclusiveDeadlineSeconds": 100, "rollout.bakeSeconds": 3600})
    driver.tick(60, latency_verdict=verdict(VerdictKind.NO_DATA))
    assert stall_events(driver.reasons()) == 0, "inconclusive, but not stalled yet"
    stalled = driver.tick(120, latency_verdict=verdict(VerdictKind.NO_DATA))
    [warning] = [event for event in stalled.events if event.reason == "AnalysisStalled"]
    assert warning.type == "Warning"
    assert "no conclusive check for 120 s" in warning.message and "keeps serving" in warning.message
    for _ in range(3):  # every later check of the same stall: no new event
        driver.tick(60, latency_verdict=verdict(VerdictKind.NO_DATA))
    assert stall_events(driver.reasons()) == 1
    assert driver.phase == "LatencyAnalysis" and driver.world.deployments, "the canary still runs"
    assert driver.condition("LatencyGatePassed") == ("Unknown", "AnalysisStalled")

    driver.tick(60, latency_verdict=verdict(VerdictKind.PASS))  # the stall ends ...
    driver.tick(60, latency_verdict=verdict(VerdictKind.NO_DATA))
    driver.tick(120, latency_verdict=verdict(VerdictKind.NO_DATA))  # ... and a new one begins
    assert stall_events(driver.reasons()) == 2
