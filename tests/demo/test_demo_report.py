from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from kvpolicy_dev.demo import scenarios
from kvpolicy_dev.demo.report import (
    DEPLOYMENTS_FILE,
    POLICIES_FILE,
    REAL_VLLM_SERVERS,
    Observed,
    RunFacts,
    policy_events,
    write_report,
)

FACTS = RunFacts("2026-11-30T10:00:00Z", 95.0, "x86_64, 2 CPUs", "Prometheus 2.42", "demo mode", 1234, 2)
FIGURES = {"itl": [{"title": "Llama-3.1-8B on H200", "breakEvenTokens": 7731.2}]}


def _statuses() -> dict[str, dict[str, Any]]:
    plan = {
        "kvCacheDtype": "FP8",
        "vllmKvCacheDtype": "fp8",
        "image": scenarios.MISLABELLED_IMAGE,
        "extraArgs": ["--kv-cache-dtype", "fp8"],
        "reasons": [{"code": "TwoLevelAccumulationImage", "message": "the canary runs the patched image"}],
    }
    return {
        "llama-longdoc-unfixed": {
            "phase": "RolledBack",
            "gpu": {"generation": "Hopper", "product": "NVIDIA-H200", "source": "Family", "message": "2 Hopper nodes"},
            "plan": plan,
            "accuracy": {
                "verdict": "Fail",
                "canaryScore": 0.12,
                "baselineScore": 0.9,
                "recovery": 0.13,
                "recoveryLow": 0.08,
                "recoveryHigh": 0.2,
                "lengthTokens": 131072,
                "samples": 40,
                "task": "multikey",
                "promptFormat": "Completion",
            },
            "decision": {
                "result": "RolledBack",
                "reason": "AccuracyRecoveryBelowMinimum",
                "time": "2026-11-30T10:00:00Z",
            },
        },
        "support-chat": {"phase": "AccuracyGate", "message": "waiting for the gate"},
    }


def test_report_has_the_table_the_policies_and_the_figures(make_policy: Any, tmp_path: Path) -> None:
    objects = [make_policy(name, status) for name, status in _statuses().items()]
    events = {"llama-longdoc-unfixed": ["t Warning AccuracyGateFailed: recovery 0.13"]}
    deployments = [scenarios.deployment(s) for s in scenarios.SCENARIOS[:1]]
    observed = Observed(objects, events, deployments)
    path = write_report(tmp_path, FACTS, observed, scenarios.SCENARIOS, FIGURES)
    text = path.read_text()
    assert "| llama-longdoc-unfixed | H200 (Hopper) | FP8 | 12% / 90% | - | - | RolledBack |" in text
    assert "| support-chat | - | - | - | - | - | AccuracyGate | - |" in text
    assert "recovery 0.13 (interval 0.08-0.20), NIAH (multikey, Completion) canary 12% vs baseline 90%" in text
    assert "`TwoLevelAccumulationImage`: the canary runs the patched image" in text
    assert "No decision: phase AccuracyGate — waiting for the gate" in text
    assert "Warning AccuracyGateFailed" in text
    assert "break-even 7,731 tokens" in text and "(niah_accuracy.png)" in text
    assert "Hopper, an image that claims two-level accumulation" in text
    assert "Users sent 1,234 requests, 2 of them failed." in text
    assert (
        "llama-longdoc-unfixed now runs image `vllm/vllm-openai:v0.12.0`, `vllm serve meta-llama/Llama-3.1-8B-Instruct "
        "--max-model-len 131072 --port 8000`"
    ) in text
    assert "support-chat now runs" not in text  # its Deployment was not observed
    saved = list(yaml.safe_load_all((tmp_path / POLICIES_FILE).read_text()))
    assert [obj["metadata"]["name"] for obj in saved] == list(_statuses())
    [deployment] = yaml.safe_load_all((tmp_path / DEPLOYMENTS_FILE).read_text())
    assert deployment == deployments[0]


def test_report_says_where_its_numbers_came_from(make_policy: Any, tmp_path: Path) -> None:
    observed = Observed([make_policy("support-chat", {})])
    simulated = write_report(tmp_path / "sim", FACTS, observed, scenarios.SCENARIOS, None).read_text()
    assert "the simulators' accuracy follows emulated FP8 accumulation" in simulated
    real_facts = replace(FACTS, servers=REAL_VLLM_SERVERS)
    real = write_report(tmp_path / "real", real_facts, observed, scenarios.SCENARIOS, None).read_text()
    assert "the model pods ran real vLLM 0.32.0" in real and "serving a real model, SmolLM2-135M-Instruct" in real
    assert "twin" not in real and "accuracy scores are simulated" not in real


def test_the_real_models_accuracy_gate_is_shown_prompt_by_prompt(make_policy: Any, tmp_path: Path) -> None:
    prompts = ["accuracy: 1/20 prompts, 4 needles: canary 0.750, baseline 0.750", "accuracy: 2/20 prompts, 8 needles"]
    observed = Observed([make_policy("support-chat", {})], accuracy_prompts={"support-chat": prompts})
    real_facts = replace(FACTS, servers=REAL_VLLM_SERVERS)
    text = write_report(tmp_path, real_facts, observed, scenarios.SCENARIOS, None).read_text()
    assert "Accuracy gate, prompt by prompt" in text and "\n".join(prompts) in text


def test_report_says_when_figures_are_missing(make_policy: Any, tmp_path: Path) -> None:
    path = write_report(tmp_path, FACTS, Observed([make_policy("support-chat", {})]), scenarios.SCENARIOS, None)
    assert "figures could not be drawn" in path.read_text()


def test_latency_ratios_are_listed(make_policy: Any, tmp_path: Path) -> None:
    latency = {"checks": 3, "passes": 3, "last": {"verdict": "Pass", "ratios": {"itl_p50": 0.8, "ttft_p95": 1.01},
               "canaryRequests": 20, "baselineRequests": 21}}  # fmt: skip
    path = write_report(tmp_path, FACTS, Observed([make_policy("llama-longdoc", {"latency": latency})]), [], FIGURES)
    assert "3 passing of 3 checks; last **Pass** (itl_p50 0.80, ttft_p95 1.01; requests canary 20, baseline 21)" in (
        path.read_text()
    )


def test_events_are_grouped_per_policy_in_time_order() -> None:
    def event(name: str, kind: str, when: str, reason: str) -> dict[str, Any]:
        involved = {"kind": kind, "name": name}
        return {"involvedObject": involved, "lastTimestamp": when, "type": "Normal", "reason": reason, "message": "m"}

    events = [
        event("a", "KVPolicy", "2026-11-30T10:00:02Z", "Second"),
        event("a", "KVPolicy", "2026-11-30T10:00:01Z", "First"),
        event("a", "Deployment", "2026-11-30T10:00:00Z", "NotAPolicy"),
        event("b", "KVPolicy", "2026-11-30T10:00:03Z", "Other"),
    ]
    assert policy_events(events) == {
        "a": ["2026-11-30T10:00:01Z Normal First: m", "2026-11-30T10:00:02Z Normal Second: m"],
        "b": ["2026-11-30T10:00:03Z Normal Other: m"],
    }


def test_the_accuracy_gates_length_profile_is_a_table_per_bucket(make_policy: Any, tmp_path: Path) -> None:
    buckets = [
        {"lengthTokens": n, "prompts": 12, "needles": 96, "canaryScore": 0.9, "baselineScore": 0.93,
         "recovery": 0.968, "canaryOnly": 0, "baselineOnly": 3}
        for n in (16384, 32768, 65536, 131072)
    ]  # fmt: skip
    profile = {"buckets": buckets, "canaryAuc": 0.9, "baselineAuc": 0.93, "aucRecovery": 0.968,
               "systematicShift": True, "shiftPValue": 6e-8, "negativeBuckets": 4}  # fmt: skip
    accuracy = {"verdict": "Pass", "recovery": 0.968, "lengthTokens": 131072, "samples": 12, "profile": profile}
    text = write_report(
        tmp_path, FACTS, Observed([make_policy("llama-longdoc", {"accuracy": accuracy})]), [], FIGURES
    ).read_text()
    assert "Length profile: AUC canary 90% vs baseline 93% (recovery 0.97); **systematic shift**" in text
    assert "calibrate the KV scales" in text
    assert "  | 16,384 | 90% | 93% | 0.97 | 12 | 0 / 3 |" in text and "  | 131,072 |" in text
