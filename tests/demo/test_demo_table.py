from __future__ import annotations

from typing import Any

from kvpolicy.api.v1alpha1 import LatencyCheck
from kvpolicy_dev.demo.table import HEADERS, MISSING, decision_rows, render_markdown, render_text, worst_ratio

HOPPER = {"generation": "Hopper", "product": "NVIDIA-H200", "computeCapability": "9.0", "source": "ComputeCapability"}
FP8_PLAN = {"kvCacheDtype": "FP8", "vllmKvCacheDtype": "fp8", "skipLayers": ["sliding_window"]}
ROLLED_BACK = {"result": "RolledBack", "reason": "AccuracyGateFailed", "time": "2026-11-30T10:00:00Z"}


def test_a_rolled_back_policy_shows_its_gate_results(make_policy: Any) -> None:
    status = {
        "phase": "RolledBack",
        "gpu": HOPPER,
        "plan": FP8_PLAN,
        "accuracy": {"verdict": "Fail", "canaryScore": 0.13, "baselineScore": 0.91, "samples": 40},
        "decision": ROLLED_BACK,
    }
    [row] = decision_rows([make_policy("llama-longdoc-unfixed", status)])
    assert row.policy == "llama-longdoc-unfixed"
    assert row.gpu == "H200 (Hopper)"
    assert row.plan == "FP8, sliding_window BF16"
    assert row.niah == "13% / 91%"
    assert (row.ttft_ratio, row.itl_ratio) == (MISSING, MISSING)
    assert (row.decision, row.reason) == ("RolledBack", "AccuracyGateFailed")


def test_latency_ratios_show_the_worst_quantile_per_metric(make_policy: Any) -> None:
    last = {"verdict": "Pass", "ratios": {"ttft_p50": 0.97, "ttft_p95": 1.04, "itl_p50": 0.81, "itl_p95": 0.78}}
    status = {"phase": "Promoted", "latency": {"checks": 4, "passes": 4, "last": last}}
    [row] = decision_rows([make_policy("llama-longdoc", status)])
    assert (row.ttft_ratio, row.itl_ratio) == ("1.04", "0.81")


def test_worst_ratio_ignores_other_metrics_and_handles_absence() -> None:
    check = LatencyCheck(verdict="Pass", ratios={"ttft_p95": 1.2, "error_ratio": 9.0})
    assert worst_ratio(check, "ttft") == 1.2
    assert worst_ratio(check, "itl") is None
    assert worst_ratio(None, "ttft") is None


def test_an_undecided_policy_shows_its_phase_not_a_decision(make_policy: Any) -> None:
    [row] = decision_rows([make_policy("support-chat", {"phase": "Planning"})])
    assert (row.decision, row.reason, row.gpu, row.plan) == ("Planning", MISSING, MISSING, MISSING)
    [fresh] = decision_rows([make_policy("support-chat", {})])
    assert fresh.decision == "Pending"


def test_text_table_aligns_columns(make_policy: Any) -> None:
    rows = decision_rows(
        [
            make_policy("support-chat", {"plan": {"kvCacheDtype": "BF16", "vllmKvCacheDtype": "auto"}}),
            make_policy("gpt-oss-20b", {"plan": FP8_PLAN}),
        ]
    )
    lines = render_text(rows).splitlines()
    assert lines[0].split() == [word for header in HEADERS for word in header.split()]
    assert set(lines[1]) == {"-", " "}
    # Every column starts at the same offset on every line.
    plan_offset = lines[0].index("plan")
    assert lines[2][plan_offset:].startswith("BF16")
    assert lines[3][plan_offset:].startswith("FP8, sliding_window BF16")


def test_markdown_table_escapes_pipes(make_policy: Any) -> None:
    decision = {**ROLLED_BACK, "reason": "a|b"}
    rows = decision_rows([make_policy("gemma-ttft", {"decision": decision})])
    text = render_markdown(rows)
    header, rule, body = text.splitlines()
    assert header.count("|") == rule.count("|") == len(HEADERS) + 1
    assert "a\\|b" in body
