"""Pure builders: names, vLLM flag rewriting, exact container patches, canary and Job manifests."""

from __future__ import annotations

import copy

import jsonpatch
import pytest
from kvpolicy.api.v1alpha1 import KVCacheDtype, Plan, PodTemplateRecord
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.gates import accuracy, latency_probe
from kvpolicy.rollout.step_types import Kind, Patch, PodView
from kvpolicy.rollout.targets.deployment import DeploymentTarget
from operator_helpers import CONFIG, TARGET_ARGS, make_policy, target_deployment

FP8_PLAN = Plan(
    kv_cache_dtype=KVCacheDtype.FP8,
    vllm_kv_cache_dtype="fp8",
    image="patched:1",
    extra_args=["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window"],
)
# A Hopper plan: FlashAttention-3 serves the FP8 KV cache, and the GPU preflight probes it.
FA3_PLAN = FP8_PLAN.model_copy(
    update={
        "attention_backend": "FLASH_ATTN",
        "extra_args": [*FP8_PLAN.extra_args, "--attention-backend", "FLASH_ATTN"],
    }
)
POLICY = b.PolicyRef(name="llama-fp8", namespace="serving", uid="uid-1")
DEPLOYMENT = DeploymentTarget()


def test_child_names_are_deterministic_and_fit_63_characters() -> None:
    assert b.canary_name("llama", 3) == "llama-canary-g3"
    long_a, long_b = "a" * 80, "a" * 79 + "b"
    name_a, name_b = b.canary_name(long_a, 12), b.canary_name(long_b, 12)
    assert len(name_a) <= 63 and len(name_b) <= 63
    assert name_a != name_b and name_a == b.canary_name(long_a, 12)
    assert name_a.endswith("-canary-g12")
    assert b.job_name("7b-model", "accuracy", 1).startswith("kvp-7b-model-"), "Service names start with a letter"
    assert b.job_name("kvp-7b-model", "accuracy", 1) == "kvp-7b-model-accuracy-g1"
    assert b.job_name("7b-model", "accuracy", 1) != b.job_name("kvp-7b-model", "accuracy", 1)


def test_dotted_names_become_dns_1035_labels_unique_to_the_policy() -> None:
    dotted, dashed = b.canary_name("llama-3.1-8b", 1), b.canary_name("llama-3-1-8b", 1)
    assert dashed == "llama-3-1-8b-canary-g1"
    assert dotted.startswith("llama-3-1-8b-") and dotted.endswith("-canary-g1") and "." not in dotted
    assert dotted != dashed, "two policies must never share a canary"


def test_policy_label_values_fit_63_characters() -> None:
    assert b.policy_labels("llama-3.1-8b") == {b.POLICY_LABEL: "llama-3.1-8b"}, "dots are legal in label values"
    long = "x" * 200
    value = b.policy_labels(long)[b.POLICY_LABEL]
    assert len(value) == 63 and value != b.policy_labels("x" * 199 + "y")[b.POLICY_LABEL]
    canary = b.canary_deployment(
        b.PolicyRef(long, "serving", "uid-1"), b.canary_name(long, 1), target_deployment(), make_policy().spec, FP8_PLAN
    )
    assert canary["spec"]["selector"]["matchLabels"][b.POLICY_LABEL] == value


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (["serve", "m", "--kv-cache-dtype", "fp8", "--port", "8000"], ["serve", "m", "--port", "8000"]),
        (["serve", "m", "--kv-cache-dtype=fp8_e4m3"], ["serve", "m"]),
        (["serve", "--kv-cache-dtype-skip-layers", "0", "1", "23", "--x"], ["serve", "--x"]),
        (["serve", "--attention-backend", "FLASHINFER"], ["serve"]),
        (["serve", "--kv-cache-dtype-skip-layers", "sliding_window"], ["serve"]),
    ],
)
def test_strip_kv_flags(tokens: list[str], expected: list[str]) -> None:
    assert b.strip_kv_flags(tokens) == expected


def test_with_plan_replaces_the_flags_in_args_or_in_the_command() -> None:
    in_args = PodTemplateRecord(image="vllm:1", args=["serve", "m", "--kv-cache-dtype", "auto"])
    planned = b.with_plan(in_args, FP8_PLAN)
    assert planned.image == "patched:1"
    assert planned.args == ["serve", "m", *FP8_PLAN.extra_args]
    assert b.with_plan(planned, FP8_PLAN) == planned, "idempotent"
    in_command = PodTemplateRecord(image="vllm:1", command=["vllm", "serve", "m"])
    assert b.with_plan(in_command, FP8_PLAN).command == ["vllm", "serve", "m", *FP8_PLAN.extra_args]
    assert b.runs_fp8(planned) and not b.runs_fp8(in_args)
    assert b.without_fp8(planned).args == ["serve", "m"]


def test_container_patch_restores_a_template_exactly() -> None:
    original = target_deployment()
    record = b.container_record(DEPLOYMENT.container(original, None))
    promoted = jsonpatch.apply_patch(
        original, b.container_patch(original, None, b.with_plan(record, FP8_PLAN)), in_place=False
    )
    promoted_container = DEPLOYMENT.container(promoted, None)
    promoted_container["command"] = ["python", "-m", "vllm"]  # the patch must also remove what the record lacks
    restored = jsonpatch.apply_patch(promoted, b.container_patch(promoted, "vllm", record))
    assert restored == original


def test_container_patch_tests_the_container_name() -> None:
    deployment = target_deployment()
    patch = b.container_patch(deployment, "vllm", PodTemplateRecord(image="x"))
    renamed = copy.deepcopy(deployment)
    renamed["spec"]["template"]["spec"]["containers"][0]["name"] = "other"
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(renamed, patch)


def test_missing_container_names_the_field_to_fix() -> None:
    with pytest.raises(b.TargetShapeError, match=r"no container 'sidecar' \(it has: vllm\).*targetRef.container"):
        b.container_index(target_deployment(), "sidecar")


@pytest.mark.parametrize(
    ("container", "port"),
    [
        ({"ports": [{"name": "metrics", "containerPort": 9000}, {"name": "http", "containerPort": 8080}]}, 8080),
        ({"ports": [{"containerPort": 7000}]}, 7000),
        ({"args": ["serve", "--port", "8123"]}, 8123),
        ({"args": ["serve", "--port=8124"]}, 8124),
        ({}, 8000),
    ],
)
def test_serving_port(container: dict[str, object], port: int) -> None:
    assert b.serving_port(container) == port


def test_canary_deployment_joins_only_when_asked() -> None:
    spec = make_policy(**{"rollout.canaryReplicas": 2}).spec
    target = target_deployment()
    canary = b.canary_deployment(POLICY, "llama-fp8-canary-g1", target, spec, FP8_PLAN)
    assert canary["spec"]["replicas"] == 2 and canary["spec"]["strategy"] == {"type": "Recreate"}
    assert canary["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "h200"}
    assert DEPLOYMENT.container(canary, None)["args"] == [*TARGET_ARGS, *FP8_PLAN.extra_args]
    assert not DEPLOYMENT.is_joined(canary, target)
    assert target["spec"]["template"]["metadata"]["labels"] == {"app": "llama", "tier": "serving"}, "not mutated"


def test_a_deployment_canary_joins_by_labelling_its_running_pods_not_its_template() -> None:
    """Issue 23 item 6: a template change would replace the pod that passed the accuracy gate with a cold one."""
    spec = make_policy(**{"rollout.canaryReplicas": 2}).spec
    target = target_deployment()
    name = "llama-fp8-canary-g1"
    canary = b.canary_deployment(POLICY, name, target, spec, FP8_PLAN)
    own = canary["spec"]["template"]["metadata"]["labels"]
    pods = [
        PodView(f"{name}-a", "10.0.0.1", True, labels=own),
        PodView(f"{name}-b", "10.0.0.2", False, labels={**own, "app": "llama", "tier": "serving"}),  # joined already
        PodView("llama-fp8-canary-g0-a", "10.0.0.3", True, labels={**own, b.CANARY_LABEL: "llama-fp8-canary-g0"}),
    ]
    actions = DEPLOYMENT.join_actions(POLICY, name, canary, target, pods)
    assert actions == [Patch(Kind.POD, f"{name}-a", {"metadata": {"labels": {"app": "llama", "tier": "serving"}}})]
    joined = [PodView(p.name, p.ip, p.ready, labels={**p.labels, "app": "llama", "tier": "serving"}) for p in pods]
    assert DEPLOYMENT.join_actions(POLICY, name, canary, target, joined) == [], "nothing more once joined"
    # The ReplicaSet keeps the labelled pods: its selector is a subset of their labels.
    assert all(joined[0].labels[k] == v for k, v in canary["spec"]["selector"]["matchLabels"].items())


def test_gate_job_is_single_shot_with_a_deadline_and_a_termination_message() -> None:
    spec = make_policy().spec
    job = b.gate_job(
        POLICY,
        b.GateJob(
            name="llama-fp8-accuracy-g1",
            role=b.ROLE_GATE,
            image="kvpolicy:1",
            command=accuracy.command(spec, "http://c:8000", "http://b:8000"),
            timeout_seconds=3600,
            resources=CONFIG.gate_resources,
            pod_placement={},
        ),
    )
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 3600
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"][b.ROLE_LABEL] == "gate"
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["automountServiceAccountToken"] is False
    gate = pod["spec"]["containers"][0]
    assert gate["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert gate["command"][gate["command"].index("--min-recovery") + 1] == "0.95"
    assert job["metadata"]["ownerReferences"][0]["kind"] == "KVPolicy"


def test_latency_probe_sweeps_at_least_three_lengths_up_to_the_longest() -> None:
    spec = make_policy(**{"workload.maxContextTokens": 32768, "workload.typicalContextTokens": 8192}).spec
    assert latency_probe.lengths(spec) == [2048, 8192, 32768]
    command = latency_probe.command(spec, "http://c:8000", "http://b:8000")
    start = command.index("--workload-lengths") + 1
    assert command[start : start + 2] == ["8192", "32768"]
    full = make_policy(**{"workload.typicalContextTokens": 131072}).spec
    assert latency_probe.lengths(full) == [8184, 32736, 130944], "the longest leaves room for the answer"


def test_the_gate_jobs_carry_the_baseline_pace_and_the_canary_pods() -> None:
    """Issue 23 item 7: the accuracy gate's prompts to production keep gates.accuracy.baselineRequestsPerMinute; the
    latency probe loads the canary's pods as a baseline pod is loaded."""
    unpaced = make_policy().spec
    assert "--baseline-requests-per-minute" not in accuracy.command(unpaced, "http://c", "http://b")
    paced = make_policy(**{"gates.accuracy.baselineRequestsPerMinute": 30}).spec
    command = accuracy.command(paced, "http://c", "http://b")
    assert command[command.index("--baseline-requests-per-minute") + 1] == "30"
    two = make_policy(**{"rollout.canaryReplicas": 2}).spec
    command = latency_probe.command(two, "http://c", "http://b")
    assert command[command.index("--canary-pods") + 1] == "2"
    assert "--no-match-load" not in command
