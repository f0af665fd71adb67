"""Table tests of the pure assessors: one check's verdict, and the analysis state machine."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from kvpolicy.analysis.model import (
    Action,
    AnalysisState,
    LatencyGateConfig,
    ProviderUnavailableError,
    SideMetrics,
    Verdict,
)
from kvpolicy.analysis.verdicts import assess, next_analysis_state
from kvpolicy.api.v1alpha1 import GateVerdict, LatencyAnalysis, OnInconclusive
from kvpolicy.rollout.latency_phase import analysis_state, record_check
from kvpolicy.rollout.step_types import timestamp

CONFIG = LatencyGateConfig(
    ttft_max_ratio=1.2,
    itl_max_ratio=1.1,
    quantiles=(0.5, 0.95),
    window_seconds=60,
    min_requests=20,
    interval_seconds=30,
    consecutive_failure_limit=3,
    on_inconclusive=OnInconclusive.HOLD,
    inconclusive_deadline_seconds=600,
    bake_seconds=120,
)
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def side(
    role: str,
    ttft: tuple[float | None, float | None] = (0.100, 0.200),
    itl: tuple[float | None, float | None] = (0.010, 0.020),
    requests: float = 100,
    series_found: bool = True,
    error_ratio: float | None = 0.0,
) -> SideMetrics:
    return SideMetrics(
        role=role,
        series_found=series_found,
        requests=requests,
        window_seconds=60,
        ttft_seconds=dict(zip((0.5, 0.95), ttft, strict=True)),
        itl_seconds=dict(zip((0.5, 0.95), itl, strict=True)),
        itl_metric="inter_token_latency_seconds",
        error_ratio=error_ratio,
    )


BASELINE = side("baseline")


@pytest.mark.parametrize(
    ("canary", "baseline", "kind", "reason"),
    [
        pytest.param(side("canary"), BASELINE, GateVerdict.PASS, "WithinThresholds", id="equal"),
        pytest.param(side("canary", ttft=(0.119, 0.239)), BASELINE, GateVerdict.PASS, "WithinThresholds", id="1.19x"),
        pytest.param(side("canary", ttft=(0.05, 0.1)), BASELINE, GateVerdict.PASS, "WithinThresholds", id="faster"),
        pytest.param(side("canary", ttft=(0.1, 0.25)), BASELINE, GateVerdict.BREACH, "TTFTRatioExceeded", id="p95"),
        pytest.param(side("canary", itl=(0.0115, 0.02)), BASELINE, GateVerdict.BREACH, "ITLRatioExceeded", id="itl"),
        pytest.param(
            side("canary", ttft=(0.2, 0.2), itl=(0.02, 0.02)),
            BASELINE,
            GateVerdict.BREACH,
            "LatencyRatioExceeded",
            id="both",
        ),
        pytest.param(
            side("canary", series_found=False, requests=0), BASELINE, GateVerdict.NO_DATA, "NoCanarySeries", id="empty"
        ),
        pytest.param(
            side("canary"),
            side("baseline", series_found=False, requests=0),
            GateVerdict.NO_DATA,
            "NoBaselineSeries",
            id="empty-baseline",
        ),
        pytest.param(
            side("canary", requests=19), BASELINE, GateVerdict.NO_DATA, "TooFewCanaryRequests", id="few-canary"
        ),
        pytest.param(
            side("canary"), side("baseline", requests=3), GateVerdict.NO_DATA, "TooFewBaselineRequests", id="few-base"
        ),
        # Slow but too few requests to judge: missing data is not a breach either.
        pytest.param(
            side("canary", ttft=(9.0, 9.0), requests=5), BASELINE, GateVerdict.NO_DATA, "TooFewCanaryRequests", id="few"
        ),
        pytest.param(
            side("canary", itl=(None, None)), BASELINE, GateVerdict.NO_DATA, "MissingLatencyQuantile", id="no-itl"
        ),
        pytest.param(
            side("canary"), side("baseline", ttft=(0.1, None)), GateVerdict.NO_DATA, "MissingLatencyQuantile", id="nan"
        ),
    ],
)
def test_assess(canary: SideMetrics, baseline: SideMetrics, kind: GateVerdict, reason: str) -> None:
    verdict = assess(CONFIG, canary, baseline)
    assert (verdict.kind, verdict.reason) == (kind, reason), verdict.message
    assert verdict.canary is canary and verdict.baseline is baseline


def test_breach_reports_every_ratio_and_names_the_breach() -> None:
    verdict = assess(CONFIG, side("canary", ttft=(0.1, 0.3)), BASELINE)
    assert verdict.ratio("ttft", 0.95) == pytest.approx(1.5)
    assert verdict.ratio("ttft", 0.5) == pytest.approx(1.0)
    assert verdict.ratio("itl", 0.95) == pytest.approx(1.0)
    assert len(verdict.checks) == 4
    assert "TTFT p95 300.0 ms is 1.50x baseline 200.0 ms (max 1.20x)" in verdict.message
    assert "p50" not in verdict.message


def test_a_metric_without_threshold_is_not_compared() -> None:
    config = replace(CONFIG, itl_max_ratio=None)
    verdict = assess(config, side("canary", itl=(None, None)), BASELINE)
    assert verdict.kind is GateVerdict.PASS
    assert {check.metric for check in verdict.checks} == {"ttft"}


def test_error_ratio_gates_only_when_configured() -> None:
    failing = side("canary", error_ratio=0.2)
    assert assess(CONFIG, failing, BASELINE).kind is GateVerdict.PASS
    verdict = assess(replace(CONFIG, max_error_ratio=0.05), failing, BASELINE)
    assert (verdict.kind, verdict.reason) == (GateVerdict.BREACH, "ErrorRatioExceeded")
    assert "0.200" in verdict.message


def test_verdict_serialises_to_json_types() -> None:
    import json

    verdict = assess(CONFIG, side("canary", ttft=(0.1, 0.3)), side("baseline", itl=(0.01, 0.02)))
    data = json.loads(json.dumps(verdict.to_dict()))
    assert data["kind"] == "Breach"
    assert data["canary"]["ttftSeconds"] == {"p50": 0.1, "p95": 0.3}
    assert data["checks"][1] == {
        "metric": "ttft",
        "statistic": "p95",
        "quantile": 0.95,
        "canarySeconds": 0.3,
        "baselineSeconds": 0.2,
        "ratio": 1.5,
        "maxRatio": 1.2,
        "breached": True,
        "resolved": True,
        "sharedBucketSeconds": None,
    }
    assert data["meanChecks"] == []


PASS = assess(CONFIG, side("canary"), BASELINE)
BREACH = assess(CONFIG, side("canary", ttft=(0.5, 0.5)), BASELINE)
NO_DATA = assess(CONFIG, side("canary", requests=0), BASELINE)
UNAVAILABLE = Verdict.provider_unavailable(ProviderUnavailableError("PrometheusUnreachable", "connection refused"))


def run(verdicts: list[tuple[int, Verdict]], config: LatencyGateConfig = CONFIG) -> list[tuple[Action, str]]:
    """Feed (seconds since start, verdict) pairs through the state machine; the outcome of each."""
    state = AnalysisState.start(T0)
    outcomes = []
    for seconds, verdict in verdicts:
        state, outcome = next_analysis_state(config, state, verdict, T0 + timedelta(seconds=seconds))
        outcomes.append((outcome.action, outcome.reason))
    return outcomes


C, P, R, H = Action.CONTINUE, Action.PROMOTE, Action.ROLLBACK, Action.HOLD


@pytest.mark.parametrize(
    ("verdicts", "expected"),
    [
        pytest.param(
            [(30, PASS), (60, PASS), (90, PASS), (120, PASS)],
            [(C, "Baking"), (C, "Baking"), (C, "Baking"), (P, "AnalysisPassed")],
            id="promote-after-bake",
        ),
        # 120 s of bake over 60 s windows needs two passes even when the bake is over.
        pytest.param([(200, PASS), (230, PASS)], [(C, "Baking"), (P, "AnalysisPassed")], id="needs-two-passes"),
        pytest.param(
            [(30, BREACH), (60, BREACH), (90, BREACH)],
            [(C, "TTFTRatioExceeded"), (C, "TTFTRatioExceeded"), (R, "TTFTRatioExceeded")],
            id="rollback-at-limit",
        ),
        # A pass in between resets the streak (flaky metrics must not roll back).
        pytest.param(
            [(30, BREACH), (60, BREACH), (90, PASS), (120, BREACH), (150, BREACH)],
            [
                (C, "TTFTRatioExceeded"),
                (C, "TTFTRatioExceeded"),
                (C, "Baking"),
                (C, "TTFTRatioExceeded"),
                (C, "TTFTRatioExceeded"),
            ],
            id="pass-resets-streak",
        ),
        # Missing data neither breaks nor extends a streak.
        pytest.param(
            [(30, BREACH), (60, NO_DATA), (90, BREACH), (120, UNAVAILABLE), (150, BREACH)],
            [
                (C, "TTFTRatioExceeded"),
                (C, "TooFewCanaryRequests"),
                (C, "TTFTRatioExceeded"),
                (C, "PrometheusUnreachable"),
                (R, "TTFTRatioExceeded"),
            ],
            id="inconclusive-keeps-streak",
        ),
        # Missing data never promotes, however long the bake.
        pytest.param(
            [(30, PASS), (300, NO_DATA), (500, UNAVAILABLE)],
            [(C, "Baking"), (C, "TooFewCanaryRequests"), (C, "PrometheusUnreachable")],
            id="no-data-never-promotes",
        ),
        # Stalled past the deadline (600 s after the first inconclusive check at 30 s): Hold, then data resumes.
        pytest.param(
            [(30, NO_DATA), (600, NO_DATA), (630, UNAVAILABLE), (700, NO_DATA), (730, PASS), (760, PASS)],
            [
                (C, "TooFewCanaryRequests"),
                (C, "TooFewCanaryRequests"),
                (H, "AnalysisStalled"),
                (H, "AnalysisStalled"),
                (C, "Baking"),
                (P, "AnalysisPassed"),
            ],
            id="hold-on-stall",
        ),
        # A conclusive check restarts the stall clock.
        pytest.param(
            [(30, NO_DATA), (500, BREACH), (700, NO_DATA), (1000, NO_DATA)],
            [
                (C, "TooFewCanaryRequests"),
                (C, "TTFTRatioExceeded"),
                (C, "TooFewCanaryRequests"),
                (C, "TooFewCanaryRequests"),
            ],
            id="stall-clock-restarts",
        ),
    ],
)
def test_state_machine(verdicts: list[tuple[int, Verdict]], expected: list[tuple[Action, str]]) -> None:
    assert run(verdicts) == expected


def test_rollback_on_stall_when_configured() -> None:
    config = replace(CONFIG, on_inconclusive=OnInconclusive.ROLLBACK)
    outcomes = run([(0, UNAVAILABLE), (599, UNAVAILABLE), (600, UNAVAILABLE)], config)
    assert outcomes == [(C, "PrometheusUnreachable"), (C, "PrometheusUnreachable"), (R, "AnalysisStalled")]


def test_bake_zero_promotes_on_first_pass() -> None:
    assert run([(0, PASS)], replace(CONFIG, bake_seconds=0)) == [(P, "AnalysisPassed")]


def test_state_counts_and_survives_a_restart() -> None:
    state = AnalysisState.start(T0)
    for seconds, verdict in [(30, PASS), (60, BREACH), (90, NO_DATA), (120, BREACH)]:
        state, _ = next_analysis_state(CONFIG, state, verdict, T0 + timedelta(seconds=seconds))
    counts = (state.checks, state.passes, state.breaches, state.inconclusive, state.consecutive_breaches)
    assert counts == (4, 1, 2, 1, 2)
    assert state.last_verdict is GateVerdict.BREACH and state.last_reason == "TTFTRatioExceeded"
    assert state.inconclusive_since is None
    assert state.next_check_at(CONFIG) == T0 + timedelta(seconds=150)
    # The operator keeps the state in its status (LatencyAnalysis) and reads it back after a restart.
    latency = LatencyAnalysis(started_at=timestamp(T0))
    record_check(latency, state, BREACH, T0 + timedelta(seconds=120))
    restored = analysis_state(LatencyAnalysis.model_validate(latency.to_k8s()))
    assert restored == state
    # The third breach after a restart still rolls back: the streak came back from status.
    _, outcome = next_analysis_state(CONFIG, restored, BREACH, T0 + timedelta(seconds=150))
    assert outcome.action is Action.ROLLBACK
