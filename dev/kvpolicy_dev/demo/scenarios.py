"""The demo's world: GPU node pools, the vLLM Deployments already serving on them, and one KVPolicy per scenario.

The policies follow examples/*.yaml with a name and target per scenario. Two images stand for the FP8 fix on Hopper:
`FIXED_IMAGE` is built with two-level accumulation (the kubelet stand-in runs its simulator with the fix) and
`MISLABELLED_IMAGE` is a custom build whose owners declare TwoLevelAccumulation although it was built without it
(FLASH_ATTENTION_DISABLE_FP8_TWO_LEVEL_ACCUMULATION=TRUE): the planner trusts the declaration, so only the accuracy
gate can catch it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpolicy.api.v1alpha1 import API_VERSION, KIND, MIN_PROFILE_BUCKET_TOKENS, KVPolicySpec
from kvpolicy.planning.gpu import find_product
from kvpolicy.planning.planner import DEFAULT_BREAK_EVEN_TOKENS

from kvpolicy_dev.devcluster.nodes import CPU_POOL, POOL_LABEL, NodePool
from kvpolicy_dev.devcluster.runners import GPU_RESOURCE

NAMESPACE = "default"
SERVER_PORT = 8000

BASELINE_IMAGE = "vllm/vllm-openai:v0.12.0"
FIXED_IMAGE = "ghcr.io/kvpolicy/vllm-fp8-twolevel:v0.12.0-kv0.1.0"
MISLABELLED_IMAGE = "registry.example.com/team-a/vllm-fp8-custom:v0.12.0"


def node_pools() -> list[NodePool]:
    """Fresh pools (the dev cluster may change their capacity): Hopper hosts five Deployments and their canaries,
    Blackwell one; gate Jobs run on the CPU pool."""
    return [
        NodePool("hopper", "NVIDIA-H200", nodes=2),
        NodePool("blackwell", "NVIDIA-B200", nodes=1),
        NodePool(CPU_POOL, None),
    ]


@dataclass(frozen=True)
class Scenario:
    """One Deployment already serving BF16 on a pool, and the KVPolicy that governs it (targetRef added on build)."""

    name: str
    title: str
    pool: str
    policy: Mapping[str, Any]

    @property
    def served_model_name(self) -> str:
        return str(self.policy["model"]["servedModelName"])

    @property
    def max_model_len(self) -> int:
        return int(self.policy["model"]["maxModelLen"])


_LLAMA_8B = {
    "servedModelName": "meta-llama/Llama-3.1-8B-Instruct",
    "headDim": 128,
    "numLayers": 32,
    "attention": "GQA",
    "maxModelLen": 131072,
}
_LONG_DOCUMENTS = {"maxContextTokens": 131072, "typicalContextTokens": 32768}
# The gate's prompts run at 128,000 tokens: a 131,072-token prompt leaves no room for the answer in maxModelLen.
_LLAMA_GATES = {
    # The length profile samples 16k, 32k and 64k beside 128k: the report shows recovery per bucket.
    "accuracy": {"minRecovery": "0.95", "lengthTokens": 128000, "lengthProfile": {"buckets": 4}},
    "latency": {"ttftMaxRatio": "1.10", "itlMaxRatio": "1.05"},
}

SCENARIOS = (
    Scenario(
        name="llama-longdoc-unfixed",
        title="Hopper, an image that claims two-level accumulation but lacks it",
        pool="hopper",
        policy={
            "model": _LLAMA_8B,
            "workload": _LONG_DOCUMENTS,
            "images": {"fp8Patched": MISLABELLED_IMAGE, "fp8PatchedFeatures": ["TwoLevelAccumulation"]},
            "gates": _LLAMA_GATES,
        },
    ),
    Scenario(
        name="llama-longdoc",
        title="Hopper, the two-level-accumulation image",
        pool="hopper",
        policy={
            "model": _LLAMA_8B,
            "workload": _LONG_DOCUMENTS,
            "images": {"fp8Patched": FIXED_IMAGE, "fp8PatchedFeatures": ["TwoLevelAccumulation"]},
            "gates": _LLAMA_GATES,
        },
    ),
    Scenario(
        name="llama-longdoc-b200",
        title="Blackwell, the stock image (no fix needed)",
        pool="blackwell",
        policy={"model": _LLAMA_8B, "workload": _LONG_DOCUMENTS, "gates": _LLAMA_GATES},
    ),
    Scenario(
        name="support-chat",
        title="Hopper, short-context chat (below the decode break-even)",
        pool="hopper",
        policy={
            "model": {
                "servedModelName": "Qwen/Qwen3-8B",
                "headDim": 128,
                "numLayers": 36,
                "attention": "GQA",
                "maxModelLen": 32768,
            },
            "workload": {"maxContextTokens": 8192, "typicalContextTokens": 2048},
            "images": {"fp8Patched": FIXED_IMAGE},
        },
    ),
    Scenario(
        name="gemma-ttft",
        title="Hopper, head_dim 256 behind a time-to-first-token objective",
        pool="hopper",
        policy={
            "model": {
                "servedModelName": "google/gemma-4-E2B-it",
                "headDim": 256,
                "numLayers": 30,
                "attention": "GQA",
                "maxModelLen": 131072,
                "slidingWindow": {"count": 24, "windowTokens": 512},
            },
            "workload": {"maxContextTokens": 65536, "typicalContextTokens": 24576, "prefillLatencyCritical": True},
            "images": {"fp8Patched": FIXED_IMAGE, "fp8PatchedFeatures": ["TwoLevelAccumulation"]},
            "gates": {"latency": {"ttftMaxRatio": "1.05"}},
        },
    ),
    Scenario(
        name="gpt-oss-20b",
        title="Hopper, a sliding-window model (those layers stay BF16)",
        pool="hopper",
        policy={
            "model": {
                "servedModelName": "openai/gpt-oss-20b",
                "headDim": 64,
                "numLayers": 24,
                "attention": "GQA",
                "maxModelLen": 131072,
                "slidingWindow": {"count": 12, "windowTokens": 128},
            },
            "workload": {"maxContextTokens": 65536, "typicalContextTokens": 16384},
            "kvCache": {"skipSlidingWindowLayers": "Auto"},
            "images": {"fp8Patched": FIXED_IMAGE},
        },
    ),
)


def fit_to_model(scenario: Scenario, max_model_len: int) -> Scenario:
    """The scenario scaled to a model with a shorter position range (the real model `--servers vllm` serves): every
    length in its policy (maxModelLen, the workload's contexts and decode break-even, the gate's length, sliding
    windows) times max_model_len / its maxModelLen, so each keeps its place relative to the others and the planner
    tells the same story. A scenario that fits already is returned as it is."""
    factor = max_model_len / scenario.max_model_len
    if factor >= 1:
        return scenario

    def scaled(tokens: Any) -> int:
        return max(1, round(int(tokens) * factor))

    policy = copy.deepcopy(dict(scenario.policy))
    model, workload = policy["model"], policy["workload"]
    model["maxModelLen"] = max_model_len
    if "slidingWindow" in model:
        model["slidingWindow"]["windowTokens"] = scaled(model["slidingWindow"]["windowTokens"])
    product = find_product(pool(scenario.pool).gpu_product or "")
    break_even = workload.get("decodeBreakEvenTokens")
    if break_even is None and product is not None:
        break_even = DEFAULT_BREAK_EVEN_TOKENS.get(product.generation)
    for key, tokens in (("maxContextTokens", workload["maxContextTokens"]),
                        ("typicalContextTokens", workload.get("typicalContextTokens")),
                        ("decodeBreakEvenTokens", break_even)):  # fmt: skip
        if tokens:
            workload[key] = scaled(tokens)
    accuracy = policy.get("gates", {}).get("accuracy", {})
    if "lengthTokens" in accuracy:
        accuracy["lengthTokens"] = scaled(accuracy["lengthTokens"])
    if "lengthProfile" in accuracy:
        # As many halvings as keep the shortest bucket long enough for the needles (the CRD's rule).
        length = accuracy.get("lengthTokens") or workload["maxContextTokens"]
        fits = max(1, (length // MIN_PROFILE_BUCKET_TOKENS).bit_length())
        profile = accuracy["lengthProfile"]
        profile["buckets"] = min(profile.get("buckets", 1), fits)
    return Scenario(scenario.name, scenario.title, scenario.pool, policy)


@dataclass(frozen=True)
class Timing:
    """How long the gates look: short enough for the demo to finish in minutes, long enough to see each step."""

    accuracy_max_samples: int
    latency_window_seconds: int
    latency_interval_seconds: int
    latency_min_requests: int
    bake_seconds: int
    progress_deadline_seconds: int


DEMO_TIMING = Timing(
    accuracy_max_samples=40,
    latency_window_seconds=10,
    latency_interval_seconds=3,
    latency_min_requests=5,
    bake_seconds=20,
    progress_deadline_seconds=120,
)
# Real vLLM (`--servers vllm`) takes about a minute to start a pod on two cores, and serves a CPU's requests per second.
VLLM_TIMING = Timing(
    accuracy_max_samples=20,
    latency_window_seconds=30,
    latency_interval_seconds=5,
    latency_min_requests=5,
    bake_seconds=30,
    progress_deadline_seconds=600,
)
FAST_TIMING = Timing(
    accuracy_max_samples=20,
    latency_window_seconds=10,
    latency_interval_seconds=2,
    latency_min_requests=3,
    bake_seconds=10,
    progress_deadline_seconds=90,
)


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def pool(name: str) -> NodePool:
    pools = node_pools()
    for candidate in pools:
        if candidate.name == name:
            return candidate
    raise ValueError(f"no node pool named {name!r}; pools: {', '.join(p.name for p in pools)}")


def _app_labels(scenario: Scenario) -> dict[str, str]:
    return {"app.kubernetes.io/name": scenario.name}


def deployment(scenario: Scenario) -> dict[str, Any]:
    """The BF16 Deployment the team already runs: one `vllm serve` replica on one GPU of its pool."""
    pool(scenario.pool)  # fail early on a typo in the table
    args = [scenario.served_model_name, "--max-model-len", str(scenario.max_model_len), "--port", str(SERVER_PORT)]
    container = {
        "name": "vllm",
        "image": BASELINE_IMAGE,
        "command": ["vllm", "serve"],
        "args": args,
        "ports": [{"name": "http", "containerPort": SERVER_PORT}],
        "resources": {"limits": {GPU_RESOURCE: "1"}, "requests": {GPU_RESOURCE: "1"}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": SERVER_PORT}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": scenario.name, "namespace": NAMESPACE, "labels": _app_labels(scenario)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _app_labels(scenario)},
            "template": {
                "metadata": {"labels": _app_labels(scenario)},
                "spec": {"nodeSelector": {POOL_LABEL: scenario.pool}, "containers": [container]},
            },
        },
    }


def service(scenario: Scenario) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": scenario.name, "namespace": NAMESPACE, "labels": _app_labels(scenario)},
        "spec": {
            "selector": _app_labels(scenario),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": SERVER_PORT}],
        },
    }


def kvpolicy(scenario: Scenario, timing: Timing, prometheus_url: str | None) -> dict[str, Any]:
    """The scenario's KVPolicy with the demo's timing and latency provider, validated like the API server would."""
    latency: dict[str, Any] = {
        "windowSeconds": timing.latency_window_seconds,
        "intervalSeconds": timing.latency_interval_seconds,
        "minRequests": timing.latency_min_requests,
        "consecutiveFailureLimit": 2,
        "inconclusiveDeadlineSeconds": timing.progress_deadline_seconds,
    }
    if prometheus_url is None:
        latency["provider"] = "Scrape"
    else:
        latency.update(provider="Prometheus", prometheusURL=prometheus_url)
    runtime = {
        "targetRef": {"name": scenario.name, "container": "vllm"},
        "images": {"baseline": BASELINE_IMAGE},
        "gates": {"accuracy": {"maxSamples": timing.accuracy_max_samples}, "latency": latency},
        "rollout": {
            "bakeSeconds": timing.bake_seconds,
            "progressDeadlineSeconds": timing.progress_deadline_seconds,
        },
    }
    spec = KVPolicySpec.model_validate(_merge(scenario.policy, runtime))
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": scenario.name, "namespace": NAMESPACE},
        "spec": spec.to_k8s(),
    }
