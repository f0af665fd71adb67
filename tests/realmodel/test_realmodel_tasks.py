"""RULER's tasks (gates.accuracy.task) on a real model's answers: `kvpolicy gate accuracy` against real vLLM serving
SmolLM2-135M-Instruct (the package's BF16 baseline server, judged against itself), a fixed number of prompts each.
The point is the task's prompts and scoring meeting a real model: its baseline score is above zero.

Lengths where this 135M model finds the needle (measured 2026-12-02, BENCHMARKS.md "Real model"): niah_single_1 at
the workload's 8,000 tokens (every needle); niah_multikey_2 only at a couple of hundred tokens: among ~8 distractor
needles it finds about a third, at 400 tokens (~17 distractors) none.
"""

from __future__ import annotations

import pytest
from kvpolicy.api.v1alpha1 import AccuracyTask
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmServer
from realmodel_helpers import WORKLOAD_LENGTH, run_accuracy_gate

pytestmark = [pytest.mark.realvllm, pytest.mark.realmodel]


@pytest.mark.parametrize(
    ("task", "length", "prompts"),
    [(AccuracyTask.NIAH_SINGLE_1, WORKLOAD_LENGTH, 4), (AccuracyTask.NIAH_MULTIKEY_2, 200, 12)],
)
def test_rulers_task_scores_above_zero_on_the_real_model(
    real_model_baseline: RealVllmServer, task: AccuracyTask, length: int, prompts: int
) -> None:
    baseline = real_model_baseline.url
    fixed = ("--min-samples", str(prompts), "--max-samples", str(prompts))
    run = run_accuracy_gate(f"{task.value} A/A", baseline, baseline, length, "--task", task.value, *fixed)
    report = run.report
    assert (report["task"], report["samples"], report["lengthTokens"]) == (task.value, prompts, length), report
    assert report["baselineScore"] > 0 and report["canaryScore"] > 0, report
