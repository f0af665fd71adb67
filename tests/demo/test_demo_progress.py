from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

from kvpolicy.api.v1alpha1 import KVPolicy
from kvpolicy_dev.demo.progress import ProgressDisplay, bar, policy_progress, progress_of, render_line

NOW = datetime(2026, 11, 30, 10, 0, 30, tzinfo=UTC)


def _progress(make_policy: Any, name: str, status: dict[str, Any]) -> Any:
    return policy_progress(KVPolicy.model_validate(make_policy(name, status)), NOW)


def test_running_accuracy_gate_counts_prompts_against_max_samples(make_policy: Any) -> None:
    status = {"phase": "AccuracyGate", "accuracy": {"verdict": "Running", "samples": 10, "lengthTokens": 131072}}
    progress = _progress(make_policy, "llama-longdoc", status)
    assert progress.fraction == 10 / 40
    assert progress.step == "accuracy gate"
    assert "10/40 NIAH prompts at 131,072 tokens" in progress.detail
    assert not progress.done


def test_prompts_answered_by_the_canary_drive_the_accuracy_bar(make_policy: Any) -> None:
    running = {"phase": "AccuracyGate", "accuracy": {"verdict": "Running"}}
    # Its length profile has 4 buckets: each round the canary answers a prompt at each of them.
    [progress] = progress_of([make_policy("llama-longdoc", running)], NOW, {"llama-longdoc": 120})
    assert progress.fraction == 30 / 40
    assert "30/40 NIAH prompts at 128,000 tokens (and 3 shorter lengths)" in progress.detail
    [unknown] = progress_of([make_policy("llama-longdoc", running)], NOW, {})
    assert unknown.fraction == 0.0


def test_latency_analysis_progress_is_time_into_the_bake(make_policy: Any) -> None:
    latency = {"startedAt": "2026-11-30T10:00:20Z", "checks": 3, "passes": 2, "last": {"verdict": "Pass"}}
    progress = _progress(make_policy, "llama-longdoc", {"phase": "LatencyAnalysis", "latency": latency})
    assert progress.fraction == 10 / 20  # 10 s into a 20 s bake
    assert progress.detail == "latency analysis: 2 passing of 3 checks, last check Pass"
    late = {**latency, "startedAt": "2026-11-30T09:00:00Z"}
    assert _progress(make_policy, "llama-longdoc", {"phase": "LatencyAnalysis", "latency": late}).fraction == 1.0
    # Past its phase the analysis is history: promoting shows no bar.
    promoting = _progress(make_policy, "llama-longdoc", {"phase": "Promoting", "latency": latency})
    assert (promoting.fraction, promoting.step) == (None, "")


def test_a_decision_ends_progress(make_policy: Any) -> None:
    decision = {"result": "HeldBF16", "reason": "BelowDecodeBreakEven", "time": "2026-11-30T10:00:00Z"}
    progress = _progress(make_policy, "support-chat", {"phase": "HeldBF16", "decision": decision})
    assert progress.done and progress.fraction is None
    assert progress.detail == "HeldBF16: BelowDecodeBreakEven"


def test_no_gate_running_shows_the_status_message(make_policy: Any) -> None:
    progress = _progress(
        make_policy, "support-chat", {"phase": "CanaryStarting", "message": "waiting for the canary pod"}
    )
    assert (progress.phase, progress.fraction, progress.detail) == (
        "CanaryStarting",
        None,
        "waiting for the canary pod",
    )
    assert _progress(make_policy, "support-chat", {}).phase == "Pending"


def test_bar_is_clamped_and_sized() -> None:
    assert bar(0.5, width=10) == "[#####.....]  50%"
    assert bar(2.0, width=4) == "[####] 100%"
    assert bar(-1.0, width=4) == "[....]   0%"


def test_log_mode_prints_a_line_per_milestone_only(make_policy: Any) -> None:
    stream = io.StringIO()
    display = ProgressDisplay(stream, live=False)
    running = {"phase": "AccuracyGate", "accuracy": {"verdict": "Running", "samples": 1}}
    display.update(progress_of([make_policy("llama-longdoc", running)], NOW))
    more = {"phase": "AccuracyGate", "accuracy": {"verdict": "Running", "samples": 30}}
    display.update(progress_of([make_policy("llama-longdoc", more)], NOW))
    decided = {"phase": "Promoted", "decision": {"result": "Promoted", "reason": "GatesPassed", "time": "t"}}
    display.update(progress_of([make_policy("llama-longdoc", decided)], NOW))
    lines = stream.getvalue().splitlines()
    assert lines == [
        "llama-longdoc  AccuracyGate      accuracy gate",
        "llama-longdoc  Promoted          Promoted: GatesPassed",
    ]
    assert "\x1b" not in stream.getvalue()


def test_live_mode_redraws_the_block_in_place(make_policy: Any) -> None:
    stream = io.StringIO()
    display = ProgressDisplay(stream, live=True)
    objects = [make_policy("llama-longdoc", {"phase": "Planning"}), make_policy("support-chat", {})]
    display.update(progress_of(objects, NOW))
    first = stream.getvalue()
    assert not first.startswith("\x1b[2F") and first.count("\x1b[2K") == 2
    display.update(progress_of(objects, NOW))
    second = stream.getvalue()[len(first) :]
    assert second.startswith("\x1b[2F")  # back up over the two lines drawn before
    display.note("setup done")
    display.update(progress_of(objects, NOW))
    assert not stream.getvalue().split("setup done\n")[1].startswith("\x1b[2F")


def test_live_line_has_a_bar_while_a_gate_runs(make_policy: Any) -> None:
    running = {"phase": "AccuracyGate", "accuracy": {"verdict": "Running", "samples": 20}}
    progress = _progress(make_policy, "llama-longdoc", running)
    line = render_line(progress, name_width=20, phase_width=12, live=True)
    assert line.startswith("llama-longdoc         AccuracyGate  [##########..........]  50%")
