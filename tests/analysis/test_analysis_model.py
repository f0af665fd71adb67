"""Validation of the analysis inputs and the stored state: bad input fails with a message naming what to fix."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from kvpolicy.analysis.model import AnalysisState, LatencyGateConfig, parse_ratio, quantile_label


@pytest.mark.parametrize(("text", "value"), [("1.2", 1.2), ("1", 1.0), (1.5, 1.5), (" 2.0 ", 2.0)])
def test_parse_ratio(text: str | float, value: float) -> None:
    assert parse_ratio(text, "ttftMaxRatio") == value


@pytest.mark.parametrize("text", ["", "fast", "0", "-1.2", "nan", "inf"])
def test_parse_ratio_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"^ttftMaxRatio: "):
        parse_ratio(text, "ttftMaxRatio")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"ttft_max_ratio": 0.0}, "ttft_max_ratio"),
        ({"itl_max_ratio": float("nan")}, "itl_max_ratio"),
        ({"ttft_max_ratio": None, "itl_max_ratio": None}, "both None"),
        ({"quantiles": ()}, "quantiles"),
        ({"quantiles": (0.5, 1.0)}, "quantiles"),
        ({"window_seconds": 0}, "window_seconds"),
        ({"interval_seconds": -1}, "interval_seconds"),
        ({"inconclusive_deadline_seconds": 0}, "inconclusive_deadline_seconds"),
        ({"bake_seconds": -1}, "bake_seconds"),
        ({"min_requests": 0}, "min_requests"),
        ({"consecutive_failure_limit": 0}, "consecutive_failure_limit"),
        ({"max_error_ratio": 1.5}, "max_error_ratio"),
        ({"on_inconclusive": "Ignore"}, "on_inconclusive: must be Hold or Rollback, got 'Ignore'"),
    ],
)
def test_config_rejects(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LatencyGateConfig(**changes)  # type: ignore[arg-type]


def test_config_normalises_and_serialises() -> None:
    config = LatencyGateConfig(quantiles=(0.99, 0.5, 0.99), on_inconclusive="Rollback")  # type: ignore[arg-type]
    assert config.quantiles == (0.5, 0.99)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["onInconclusive"] == "Rollback" and data["quantiles"] == [0.5, 0.99]


@pytest.mark.parametrize(("bake", "window", "passes"), [(0, 60, 1), (60, 300, 1), (600, 300, 2), (601, 300, 3)])
def test_required_passes_span_the_bake(bake: float, window: float, passes: int) -> None:
    assert LatencyGateConfig(bake_seconds=bake, window_seconds=window).required_passes == passes


@pytest.mark.parametrize(("quantile", "label"), [(0.5, "p50"), (0.95, "p95"), (0.99, "p99"), (0.999, "p99.9")])
def test_quantile_label(quantile: float, label: str) -> None:
    assert quantile_label(quantile) == label


def test_state_needs_aware_timestamps() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        AnalysisState.start(datetime(2026, 1, 1))
