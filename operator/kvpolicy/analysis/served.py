"""What a vLLM server really serves, from its own `vllm:cache_config_info`: the KV cache dtype and skip layers it
runs, whatever its pod spec asked for (an image whose entrypoint drops arguments serves something else)."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence

from kvpolicy.analysis.checks import MetricsCheck, Sides, Stage, Verification
from kvpolicy.analysis.model import Verdict
from kvpolicy.analysis.provider import MetricsProvider, ServedConfig, ServedReading
from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import ConditionType, KVPolicy, VerdictKind

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
    return ServedConfig(kv_cache_dtype=labels.get("cache_dtype", ""), skip_layers=tuple(str(layer) for layer in layers))


def reading(found: Sequence[ServedConfig | None], where: str) -> ServedReading:
    """All pods' configurations, or what is missing when a pod (or every pod) published none."""
    if not found:
        return ServedReading(missing=f"no ready pod to read at {where}")
    configs = tuple(config for config in found if config is not None)
    if len(configs) < len(found):
        return ServedReading(missing=f"{len(found) - len(configs)} pod(s) publish no vllm:{CACHE_CONFIG} at {where}")
    return ServedReading(configs=configs)


# --------------------------------------------------------------------------------- the canary configuration check


async def read_served(provider: MetricsProvider, policy: KVPolicy, sides: Sides) -> ServedReading:
    return await provider.served(sides.canary)


def assess_served(policy: KVPolicy, served: ServedReading) -> Verdict:
    """The ready canary's own vllm:cache_config_info against the plan: every pod must serve the planned KV cache
    dtype and skip layers."""
    plan = policy.status.plan
    assert plan is not None, "a canary is verified only after planning"
    planned = ServedConfig(plan.vllm_kv_cache_dtype, tuple(plan.skip_layers))
    if served.missing is not None:
        return Verdict(VerdictKind.NO_DATA, Reason.AWAITING_SERVED_CONFIG, served.missing)
    wrong = [config for config in served.configs if not config.same_kv_cache(planned)]
    if wrong:
        message = (
            f"planned {planned.describe()}, but the canary serves {wrong[0].describe()} (its vllm:cache_config_info): "
            "does its image's entrypoint pass every argument on to vLLM?"
        )
        return Verdict(VerdictKind.BREACH, DecisionReason.CANARY_CONFIG_MISMATCH, message)
    first = served.configs[0]
    message = f"the canary serves the planned {first.describe()}"
    return Verdict(VerdictKind.PASS, Reason.SERVED_AS_PLANNED, message, evidence=first)


CANARY_CONFIG: MetricsCheck[ServedReading] = MetricsCheck(
    name="canary-config",
    stage=Stage.VERIFY,
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
