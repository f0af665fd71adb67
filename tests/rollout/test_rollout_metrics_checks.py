"""The step's reaction to metrics checks made together (the table's TTFT/ITL entry and a policy's custom checks):
their verdicts count as one check, and a check only a person can fix is said once."""

from __future__ import annotations

from typing import Any

from kvpolicy.analysis.checks import CheckVerdict
from kvpolicy.analysis.custom import CustomReading, custom_checks
from kvpolicy.analysis.model import SideMetrics, Verdict
from kvpolicy.api.v1alpha1 import GateVerdict
from kvpolicy.rollout.metric_checks import LATENCY
from operator_helpers import Driver, make_policy, run_to_canary

ERRORS = '(sum(rate(vllm:request_success_total{ {{ canary }}, finished_reason="abort" }[{{ window }}])) or vector(0))'


def side(role: str) -> SideMetrics:
    return SideMetrics(role, True, 100, 60.0, {0.5: 0.1, 0.95: 0.1}, {0.5: 0.01, 0.95: 0.01})


LATENCY_PASS = Verdict(GateVerdict.PASS, "WithinThresholds", "latency fine", (), side("canary"), side("baseline"))


def analysing(**spec: Any) -> Driver:
    prometheus = {"gates.latency.provider": "Prometheus", "gates.latency.prometheusURL": "http://prometheus:9090"}
    checks = {"analysis": {"checks": [{"name": "aborts", "query": ERRORS, "range": {"max": "0.01"}}]}}
    enabled = {"gates.accuracy.enabled": False, "gates.latency.enabled": True}
    driver = Driver(make_policy(**{**enabled, **prometheus, **checks, **spec}))
    run_to_canary(driver)
    driver.tick()
    driver.world.canary_up()
    driver.tick()
    assert driver.policy.status.latency is not None and driver.policy.status.latency.started_at is not None
    return driver


def with_custom(driver: Driver, verdict: Verdict) -> dict[str, Any]:
    [entry] = custom_checks(driver.policy)
    return {"checks": (CheckVerdict(LATENCY, LATENCY_PASS), CheckVerdict(entry, verdict))}


def test_a_custom_breach_with_ttft_passing_rolls_back_with_the_custom_reason() -> None:
    driver = analysing(**{"gates.latency.consecutiveFailureLimit": 2})
    [entry] = custom_checks(driver.policy)
    breach = entry.assess(driver.policy, CustomReading(0.2))
    for _ in range(2):
        driver.tick(60, **with_custom(driver, breach))
    assert driver.phase == "RollingBack"
    decision = driver.policy.status.decision
    assert decision is not None and decision.reason == "CustomCheckBreached"
    assert "custom check aborts: canary value 0.2 is above max 0.01" in decision.message
    last = driver.policy.status.latency.last
    assert last is not None and last.values == {"aborts": 0.2}
    assert last.canary_requests == 100, "the TTFT/ITL check's figures stay with the combined check"


def test_a_custom_check_without_data_holds_the_analysis_like_ttft_no_data() -> None:
    driver = analysing(**{"gates.latency.inconclusiveDeadlineSeconds": 100})
    [entry] = custom_checks(driver.policy)
    no_data = entry.assess(driver.policy, CustomReading(None))
    driver.tick(60, **with_custom(driver, no_data))
    driver.tick(120, **with_custom(driver, no_data))
    assert driver.phase == "LatencyAnalysis"
    assert driver.condition("LatencyGatePassed") == ("Unknown", "AnalysisStalled")
    latency = driver.policy.status.latency
    assert latency.passes == 0 and latency.inconclusive == 2, "TTFT passing does not make the check a pass"


def test_a_rejected_query_is_said_once_in_a_warning_event_even_through_a_stall() -> None:
    driver = analysing(**{"gates.latency.inconclusiveDeadlineSeconds": 100, "rollout.bakeSeconds": 3600})
    rejected = Verdict(
        GateVerdict.PROVIDER_UNAVAILABLE,
        "CustomCheckQueryRejected",
        "custom check aborts: Prometheus at http://prometheus:9090 rejected ... (HTTP 400 Bad Request, bad_data)",
        needs_attention=True,
    )
    for seconds in (60, 60, 60, 60):
        driver.tick(seconds, **with_custom(driver, rejected))
    assert driver.condition("LatencyGatePassed") == ("Unknown", "AnalysisStalled")
    assert driver.reasons().count("CustomCheckQueryRejected") == 1
    driver.tick(60, **with_custom(driver, entry_pass(driver)))
    driver.tick(60, **with_custom(driver, rejected))
    assert driver.reasons().count("CustomCheckQueryRejected") == 2, "said again when it comes back"


def entry_pass(driver: Driver) -> Verdict:
    [entry] = custom_checks(driver.policy)
    return entry.assess(driver.policy, CustomReading(0.0))
