"""The canary's share of the requests on the pure step: measured from both sides' finished-request counters at each
live analysis check, against a step's weight or the pods' share; far from the intent is its own condition, and a
canary that got no request is never judged on latency."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvpolicy.analysis.model import GateVerdict, Verdict
from kvpolicy.api.v1alpha1 import ConditionStatus
from kvpolicy.plugin import view
from kvpolicy.rollout.traffic_share import judge, tolerance_points
from operator_helpers import Driver, live, make_policy, run_to_canary, side, verdict
from test_rollout_drift_and_view import ANALYSING, NOW, raw_policy
from test_rollout_traffic_router import MIRRORING, ROUTED, RoutedWorld


def counted(kind: GateVerdict, canary: float, baseline: float) -> Verdict:
    base = verdict(kind)
    assert base.canary is not None and base.baseline is not None
    return replace(
        base,
        canary=replace(base.canary, finished_requests=canary),
        baseline=replace(base.baseline, finished_requests=baseline),
    )


@pytest.mark.parametrize(
    ("intended", "canary", "baseline", "status", "reason"),
    [
        (10.0, 48, 452, ConditionStatus.TRUE, "ShareAsIntended"),
        (10.0, 150, 350, ConditionStatus.FALSE, "TrafficShareSkewed"),  # 30 % at 10 %: an endpoint picker's doing
        (50.0, 0, 40, ConditionStatus.FALSE, "NoCanaryTraffic"),
        (10.0, 0, 30, ConditionStatus.UNKNOWN, "TooFewRequests"),  # 3 expected: no traffic may be luck
        (10.0, 3, 10, ConditionStatus.UNKNOWN, "TooFewRequests"),
    ],
)
def test_a_measured_split_is_judged_against_the_intent(
    intended: float, canary: float, baseline: float, status: ConditionStatus, reason: str
) -> None:
    said = judge(intended, canary, baseline)
    assert (said[0], said[1]) == (status, reason)


def test_few_requests_widen_the_tolerance_many_do_not() -> None:
    assert tolerance_points(10.0, 20) == pytest.approx(20.1, abs=0.1)
    assert tolerance_points(10.0, 10_000) == 10.0


def test_a_replica_ratio_canary_share_is_recorded_and_a_skew_warned() -> None:
    driver = live()  # one canary pod beside the target's two: a third of the pods
    driver.tick(60, latency_verdict=counted(GateVerdict.NO_DATA, 30, 60))
    share = driver.policy.status.traffic_share
    assert share is not None
    assert (share.intended_percent, share.measured_percent) == (pytest.approx(33.33), pytest.approx(33.33))
    assert driver.condition("TrafficShareAsIntended") == ("True", "ShareAsIntended")
    driver.tick(60, latency_verdict=counted(GateVerdict.NO_DATA, 0, 90))
    assert driver.condition("TrafficShareAsIntended") == ("False", "NoCanaryTraffic")
    assert "NoCanaryTraffic" in driver.reasons()


def test_a_canary_with_no_requests_is_never_passed_on_latency() -> None:
    driver = live(**{"gates.latency.minRequests": 1, "rollout.bakeSeconds": 0})
    idle = Verdict(
        GateVerdict.NO_DATA, "NoData", "no canary requests", (), side("canary", 0, 0.1), side("baseline", 100, 0.1)
    )
    for _ in range(5):
        driver.tick(60, latency_verdict=replace(idle, canary=replace(idle.canary, finished_requests=0.0)))
    assert driver.phase == "LatencyAnalysis", "no traffic, no verdict: it holds"


def test_get_shows_the_route_step_and_the_canary_share() -> None:
    status = {
        **ANALYSING,
        "traffic": {"route": "llm", "pool": "llama", "canaryPool": "llama-fp8-canary-g4", "step": 1, "weight": 50},
        "trafficShare": {"intendedPercent": 50.0, "measuredPercent": 47.5, "canaryRequests": 95,
                         "baselineRequests": 105, "windowSeconds": 300, "at": "2026-12-01T10:04:50Z"},
    }  # fmt: skip
    inference_pool = {"httpRoute": "llm", "pool": "llama", "steps": [10, 50]}
    screen = view.render_get(raw_policy(status, traffic="InferencePool", inferencePool=inference_pool), [], NOW)
    assert (
        "Route:           HTTPRoute llm: 50% to InferencePool llama-fp8-canary-g4, 50% to llama (step 2 of 2)" in screen
    )
    assert (
        "Canary share:    measured 47.5% of requests (intended 50.0%): 95 canary / 105 baseline over 300s, 10s ago"
        in screen
    )


def test_a_mirrored_canary_is_meant_to_serve_its_copies_share_of_all_requests() -> None:
    world = RoutedWorld()
    driver = Driver(make_policy(**{**ROUTED, **MIRRORING}), world=world)
    run_to_canary(driver)
    driver.tick()
    driver.tick()
    driver.tick(60, latency_verdict=counted(GateVerdict.NO_DATA, 20, 100))
    share = driver.policy.status.traffic_share
    assert share is not None and share.intended_percent == pytest.approx(16.67)
    assert driver.condition("TrafficShareAsIntended") == ("True", "ShareAsIntended")
