"""What a vLLM server really serves, from its own `vllm:cache_config_info`: the KV cache dtype and skip layers it
runs, whatever its pod spec asked for (an image whose entrypoint drops arguments serves something else), and every
other CacheConfig field, which must equal the target's own pods' so that the gates compare the KV cache alone."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpolicy.analysis.checks import MetricsCheck, Sides, Stage, Verification
from kvpolicy.analysis.model import Verdict
from kvpolicy.analysis.provider import MetricsProvider, ServedConfig, ServedReading
from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import ConditionType, GateVerdict, KVPolicy

CACHE_CONFIG = "cache_config_info"  # without the vllm prefix (names.strip_vllm_prefix)


def served_config(labels: Mapping[str, str]) -> ServedConfig:
    """A cache_config_info sample's labels: `cache_dtype="fp8"`, `kv_cache_dtype_skip_layers="['0', '31']"`."""
    text = labels.get("kv_cache_dtype_skip_layers", "[]")
    try:
        layers = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        layers = [text]
    if not isinstance(layers, list | tuple):
        layers = [layers]
    return ServedConfig(
        kv_cache_dtype=labels.get("cache_dtype", ""),
        skip_layers=tuple(str(layer) for layer in layers),
        labels=dict(labels),
    )


def reading(found: Sequence[ServedConfig | None], where: str) -> ServedReading:
    """All pods' configurations, or what is missing when a pod (or every pod) published none."""
    if not found:
        return ServedReading(missing=f"no ready pod to read at {where}")
    configs = tuple(config for config in found if config is not None)
    if len(configs) < len(found):
        return ServedReading(missing=f"{len(found) - len(configs)} pod(s) publish no vllm:{CACHE_CONFIG} at {where}")
    return ServedReading(configs=configs)


# --------------------------------------------------------------------------------- the canary configuration check

# The labels vLLM 0.32 writes on cache_config_info: one per CacheConfig field (tests check them against the installed
# vLLM's CacheConfig). Only these are compared: a Prometheus server adds its own target labels to every series
# (instance, pod, and whatever its relabelling copies from the pod, such as pod_template_hash, which differs between
# the canary's Deployment and the target's), and `engine` is the series' engine index. A field a later release adds is
# not compared until it is listed here.
CACHE_CONFIG_FIELDS = frozenset(
    {
        "_block_size_resolved",
        "block_size",
        "cache_dtype",
        "cache_hit_alignment_tokens",
        "effective_attention_block_size",
        "enable_mamba_shared_prefix_checkpoint",
        "enable_prefix_caching",
        "gpu_memory_utilization",
        "hash_block_size",
        "is_attention_free",
        "kv_cache_dtype_skip_layers",
        "kv_cache_layout",
        "kv_cache_max_concurrency",
        "kv_cache_memory_bytes",
        "kv_cache_size_tokens",
        "kv_offloading_backend",
        "kv_offloading_size",
        "kv_sharing_fast_prefill",
        "mamba_block_size",
        "mamba_cache_dtype",
        "mamba_cache_mode",
        "mamba_page_size_padded",
        "mamba_ssm_cache_dtype",
        "num_cpu_blocks",
        "num_gpu_blocks",
        "num_gpu_blocks_override",
        "prefix_cache_retention_interval",
        "prefix_caching_hash_algo",
        "prefix_match_unit",
        "replayssm_buffer_len",
        "skip_page_size_padded",
        "sliding_window",
        "swa_bounded_replay",
        "use_kda_recoverssm",
        "use_replayssm",
        "user_specified_block_size",
    }
)
# Fields the parity check does not compare, each set with why it may differ between a fair canary and its baseline.
# What the plan changes: checked against the plan instead.
PLAN_CHANGED = frozenset({"cache_dtype", "kv_cache_dtype_skip_layers"})
# Sized after memory profiling: they follow the KV cache dtype (FP8 holds twice the tokens in the same bytes) and each
# pod's free accelerator memory, so they differ between two fair pods.
SIZED_BY_MEMORY = frozenset({"num_gpu_blocks", "num_cpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency"})
# Resolved from the attention backend when no --block-size is given (FlashInfer's and FlashAttention's block sizes and
# layouts differ), and the plan names the canary's backend: they may differ whenever the plan names one.
RESOLVED_BY_BACKEND = frozenset(
    {"block_size", "effective_attention_block_size", "kv_cache_layout", "hash_block_size", "cache_hit_alignment_tokens"}
)


@dataclass(frozen=True)
class ServedSides:
    """What the canary's pods serve, and what the target's own pods (the baseline) serve."""

    canary: ServedReading
    baseline: ServedReading


@dataclass(frozen=True)
class Difference:
    label: str
    canary: str
    baseline: str

    def describe(self) -> str:
        return f"{self.label} is {self.canary} on the canary, {self.baseline} on the target"


def differences(
    canary: Sequence[ServedConfig], baseline: Sequence[ServedConfig], backend_planned: bool
) -> list[Difference]:
    """Every CacheConfig field the canary's pods serve differently from the target's own pods, apart from those that
    may differ (above). A field the target's own pods disagree on has no one value to match; a field on one side only
    comes from another vLLM release's CacheConfig (the patched image) and has nothing to be compared with."""
    compared = (
        CACHE_CONFIG_FIELDS - PLAN_CHANGED - SIZED_BY_MEMORY - (RESOLVED_BY_BACKEND if backend_planned else set())
    )
    shared = dict(baseline[0].labels) if baseline else {}
    per_pod = {label for label, value in shared.items() for config in baseline if config.labels.get(label) != value}
    found: dict[str, Difference] = {}
    for config in canary:
        for label, value in sorted(config.labels.items()):
            expected = shared.get(label)
            if label not in compared or label in per_pod or expected is None or value == expected:
                continue
            found.setdefault(label, Difference(label, value, expected))
    return list(found.values())


async def read_served(provider: MetricsProvider, policy: KVPolicy, sides: Sides) -> ServedSides:
    return ServedSides(await provider.served(sides.canary), await provider.served(sides.baseline))


def assess_served(policy: KVPolicy, served: ServedSides) -> Verdict:
    """The ready canary's own vllm:cache_config_info against the plan (every pod must serve the planned KV cache
    dtype and skip layers), then against the target's own pods: every other label must be equal (parity)."""
    plan = policy.status.plan
    assert plan is not None, "a canary is verified only after planning"
    planned = ServedConfig(plan.vllm_kv_cache_dtype, tuple(plan.skip_layers))
    canary, baseline = served.canary, served.baseline
    if canary.missing is not None:
        return Verdict(GateVerdict.NO_DATA, Reason.AWAITING_SERVED_CONFIG, canary.missing)
    wrong = [config for config in canary.configs if not config.same_kv_cache(planned)]
    if wrong:
        message = (
            f"planned {planned.describe()}, but the canary serves {wrong[0].describe()} (its vllm:cache_config_info): "
            "does its image's entrypoint pass every argument on to vLLM?"
        )
        return Verdict(GateVerdict.BREACH, DecisionReason.CANARY_CONFIG_MISMATCH, message)
    if baseline.missing is not None:
        return Verdict(GateVerdict.NO_DATA, Reason.AWAITING_SERVED_CONFIG, f"the target's own pods: {baseline.missing}")
    found = differences(canary.configs, baseline.configs, plan.attention_backend is not None)
    if found:
        message = (
            "the canary differs from the target's own pods in more than the KV cache (vllm:cache_config_info): "
            + "; ".join(difference.describe() for difference in found)
            + "; the gates would not compare the KV cache alone"
        )
        return Verdict(GateVerdict.BREACH, DecisionReason.CANARY_CONFIG_MISMATCH, message)
    first = canary.configs[0]
    message = f"the canary serves the planned {first.describe()}, and otherwise the target's configuration"
    return Verdict(GateVerdict.PASS, Reason.SERVED_AS_PLANNED, message, evidence=first)


CANARY_CONFIG: MetricsCheck[ServedSides] = MetricsCheck(
    name="canary-config",
    stage=Stage.VERIFY,
    reads_baseline=True,
    read=read_served,
    assess=assess_served,
    verification=Verification(
        condition=ConditionType.CANARY_CONFIG_VERIFIED,
        passed_event=Reason.CANARY_CONFIG_VERIFIED,
        waiting_reason=Reason.AWAITING_SERVED_CONFIG,
        waiting=f"waiting for the canary's vllm:{CACHE_CONFIG}",
        unverified="the canary's served KV cache could not be verified",
    ),
)
