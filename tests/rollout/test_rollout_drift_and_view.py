"""The serving-configuration comparison behind drift and the mid-rollout check, and the plugin's pure views."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from kvpolicy.api.v1alpha1 import PodTemplateRecord
from kvpolicy.plugin import view
from kvpolicy.rollout import drift
from operator_helpers import TARGET_ARGS, TARGET_IMAGE, target_deployment

BASE = PodTemplateRecord(image=TARGET_IMAGE, args=TARGET_ARGS, env=[{"name": "HF_HOME", "value": "/cache"}])
NOW = datetime(2026, 12, 1, 10, 5, tzinfo=UTC)


@pytest.mark.parametrize(
    ("change", "found"),
    [
        ({"image": "vllm:0.13"}, ["Image: vllm:0.12 -> vllm:0.13"]),
        (
            {"args": [*TARGET_ARGS, "--kv-cache-dtype=fp8"]},
            ["KVArguments: (none) -> --kv-cache-dtype=fp8"],
        ),
        (
            {"args": [*TARGET_ARGS, "--kv-cache-dtype-skip-layers", "0", "1", "--enforce-eager"]},
            [
                "KVArguments: (none) -> --kv-cache-dtype-skip-layers 0 1",
                f"Arguments: {' '.join(TARGET_ARGS)} -> {' '.join(TARGET_ARGS)} --enforce-eager",
            ],
        ),
        ({"command": ["python", "-m", "vllm.entrypoints.openai.api_server"]}, ["Command: (none) -> python -m vllm"]),
        ({"env": [{"name": "HF_HOME", "value": "/data"}]}, ["Env: HF_HOME=/cache -> HF_HOME=/data"]),
        ({"env": []}, ["Env: HF_HOME=/cache -> HF_HOME unset"]),
        (
            {"env": [{"name": "HF_HOME", "value": "/cache"}, {"name": "TOKEN", "valueFrom": {"secretKeyRef": {}}}]},
            ['Env: TOKEN unset -> TOKEN={"valueFrom": {"secretKeyRef": {}}}'],
        ),
    ],
    ids=["image", "kv-equals-form", "kv-multi-value", "command", "env-value", "env-removed", "env-from"],
)
def test_differences_say_what_changed(change: dict[str, Any], found: list[str]) -> None:
    described = [d.describe() for d in drift.differences(BASE, BASE.model_copy(update=change))]
    assert len(described) == len(found)
    for text, expected in zip(described, found, strict=True):
        assert text.startswith(expected), text


def test_the_same_configuration_in_another_env_order_is_no_difference() -> None:
    env = [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    assert drift.differences(BASE.model_copy(update={"env": env}), BASE.model_copy(update={"env": env[::-1]})) == []


def test_long_values_are_shortened_in_messages() -> None:
    long_args = [*TARGET_ARGS, "--chat-template", "x" * 500]
    (difference,) = drift.differences(BASE, BASE.model_copy(update={"args": long_args}))
    assert len(difference.observed) == drift.VALUE_LIMIT and difference.observed.endswith("...")


def test_a_deployment_counts_as_rolled_out_only_when_every_pod_runs_its_template() -> None:
    deployment = target_deployment()
    deployment["metadata"]["generation"] = 3
    status = {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    assert drift.rolled_out({**deployment, "status": status})
    for stale in (
        {"observedGeneration": 2},
        {"updatedReplicas": 1},
        {"readyReplicas": 1},
        {"replicas": 3},  # an old pod still terminating
    ):
        assert not drift.rolled_out({**deployment, "status": {**status, **stale}}), stale


# ------------------------------------------------------------------------------------------------------ views


def raw_policy(status: dict[str, Any], **rollout: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpolicy.dev/v1alpha1",
        "kind": "KVPolicy",
        "metadata": {"name": "llama-fp8", "namespace": "serving", "creationTimestamp": "2026-12-01T09:00:00Z"},
        "spec": {
            "targetRef": {"name": "llama", "container": "vllm"},
            "model": {"servedModelName": "llama", "headDim": 128, "numLayers": 32, "maxModelLen": 131072},
            "workload": {"maxContextTokens": 131072},
            "rollout": {"bakeSeconds": 600, **rollout},
        },
        "status": status,
    }


ANALYSING = {
    "phase": "LatencyAnalysis",
    "phaseEnteredAt": "2026-12-01T10:02:00Z",
    "rolloutId": "4-0a1b2c",
    "rolloutGeneration": 4,
    "rolloutStartedAt": "2026-12-01T10:00:00Z",
    "plan": {
        "kvCacheDtype": "FP8",
        "vllmKvCacheDtype": "fp8",
        "extraArgs": ["--kv-cache-dtype", "fp8"],
        "gates": ["Accuracy", "Latency"],
        "reasons": [{"code": "AboveDecodeBreakEven", "message": "FP8 decodes faster", "severity": "Info"}],
    },
    "gpu": {"generation": "Blackwell", "product": "NVIDIA-B200", "computeCapability": "10.0", "nodes": 2,
            "source": "ComputeCapability"},
    "accuracy": {"verdict": "Pass", "recovery": 0.981, "recoveryLow": 0.96, "recoveryHigh": 0.99, "samples": 40,
                 "lengthTokens": 131072, "reason": "RecoveryAboveThreshold", "job": "llama-fp8-accuracy-g4",
                 "task": "multikey", "promptFormat": "Completion"},
    "latency": {
        "startedAt": "2026-12-01T10:02:00Z",
        "checks": 3,
        "passes": 3,
        "last": {"verdict": "Pass", "ratios": {"ttft_p95": 1.031, "itl_p95": 0.994}, "canaryRequests": 120,
                 "baselineRequests": 960, "at": "2026-12-01T10:04:50Z"},
    },
    "conditions": [
        {"type": "AccuracyGatePassed", "status": "True", "reason": "RecoveryAboveMinimum", "message": "ok",
         "lastTransitionTime": "2026-12-01T10:01:30Z"},
    ],
}  # fmt: skip


def test_get_shows_the_plan_gate_progress_and_latency_ratios() -> None:
    events = [
        {"type": "Normal", "reason": "TrafficJoined", "message": "joined", "lastTimestamp": "2026-12-01T10:02:00Z",
         "involvedObject": {"kind": "KVPolicy"}, "metadata": {"resourceVersion": "12"}},
        {"type": "Normal", "reason": "AccuracyGatePassed", "message": "passed", "involvedObject": {"kind": "KVPolicy"},
         "lastTimestamp": "2026-12-01T10:02:00Z", "metadata": {"resourceVersion": "11"}},
    ]  # fmt: skip
    screen = view.render_get(raw_policy(ANALYSING, approval="Manual"), events, NOW)
    assert "Status:          ◌ LatencyAnalysis  (for 3m)" in screen
    assert "Rollout:         4-0a1b2c  (generation 4, run 1, started 5m ago)" in screen
    assert "GPU:             NVIDIA-B200 (Blackwell, cc 10.0, 2 nodes)" in screen
    assert (
        "Accuracy      ✔ Pass         recovery 0.981 [0.96, 0.99] 40/100 samples per side at 131072 tokens task "
        "multikey (Completion) (RecoveryAboveThreshold)" in screen
    )
    assert "3 checks every 60s over 300s windows (3 pass, 0 breach, 0 inconclusive; 0/3 breaches in a row)" in screen
    assert (
        "last Pass 10s ago: itl_p95 0.994  ttft_p95 1.031 (limits ttft 1.10, itl 1.05; 120 canary / 960 baseline"
        in (screen)
    )
    assert "bake 600s, 420s left" in screen
    assert "Approval:        Manual" in screen
    assert screen.index("AccuracyGatePassed  passed") < screen.index("TrafficJoined       joined"), "by resourceVersion"


def test_get_of_a_drifted_advisory_policy_shows_the_drift_and_the_advice() -> None:
    status = {
        **ANALYSING,
        "phase": "Promoted",
        "decision": {"result": "Promoted", "reason": "Adopted", "message": "pods run it", "kvCacheDtype": "FP8",
                     "time": "2026-12-01T10:03:00Z"},
        "drift": {"detectedAt": "2026-12-01T10:04:00Z", "differences": [
            {"field": "Image", "expected": "vllm:0.12", "observed": "vllm:0.13"}]},
        "advice": {"rolloutId": "4-0a1b2c", "deployment": "llama", "container": "vllm", "image": "vllm:0.12",
                   "strategicMergePatch": '{"spec":{}}', "jsonPatch": "[]", "summary": "Image: a -> b"},
        "conditions": [{"type": "Drifted", "status": "True", "reason": "DriftReported", "message": "m",
                        "lastTransitionTime": "2026-12-01T10:04:00Z"}],
    }  # fmt: skip
    screen = view.render_get(raw_policy(status, applyMode="Advisory", onDrift="Report"), [], NOW)
    assert "Status:          ⚠ Promoted" in screen
    assert "Apply mode:      Advisory    On drift: Report" in screen
    assert "  Image: vllm:0.12 -> vllm:0.13" in screen
    assert "kubectl patch deployment llama -n serving --type strategic -p '{\"spec\":{}}'" in screen
    assert "Events:          <none>" in screen


def test_get_of_a_policy_whose_spec_no_longer_parses_still_shows_its_status() -> None:
    broken = raw_policy({"phase": "Promoted"})
    broken["spec"]["model"]["headDim"] = 7
    screen = view.render_get(broken, [], NOW)
    assert "Spec:            invalid: Input should be greater than or equal to 16 at spec.model.headDim" in screen
    assert "✔ Promoted" in screen


def test_list_shows_the_decided_dtype_and_the_rollout() -> None:
    rolled_back = raw_policy(
        {**ANALYSING, "phase": "RolledBack", "decision": {"result": "RolledBack", "reason": "Aborted",
                                                          "kvCacheDtype": "BF16", "time": "2026-12-01T10:03:00Z"}}
    )  # fmt: skip
    rows = view.render_list([rolled_back], NOW, all_namespaces=True).splitlines()
    assert rows[0].split() == ["NAMESPACE", "NAME", "PHASE", "KV", "ROLLOUT", "GPU", "DECISION", "REASON", "AGE"]
    assert rows[1].split() == ["serving", "llama-fp8", "✖", "RolledBack", "BF16", "4-0a1b2c", "NVIDIA-B200",
                               "RolledBack", "Aborted", "65m"]  # fmt: skip
    assert view.render_list([], NOW, all_namespaces=False) == "No KVPolicies found.\n"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (5, "5s"),
        (119, "119s"),
        (185, "3m5s"),
        (600, "10m"),
        (7500, "125m"),
        (11000, "3h3m"),
        (30000, "8h"),
        (200000, "2d7h"),
        (900000, "10d"),
    ],
)
def test_ages_read_like_kubectl(seconds: int, shown: str) -> None:
    then = datetime.fromtimestamp(NOW.timestamp() - seconds, UTC).isoformat().replace("+00:00", "Z")
    assert view.age(then, NOW) == shown
