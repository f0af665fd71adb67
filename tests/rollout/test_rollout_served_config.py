"""The canary really runs what the plan says: its own vllm:cache_config_info against the plan, before any gate."""

from __future__ import annotations

import pytest
from kvpolicy.analysis.model import Verdict
from kvpolicy.analysis.provider import ServedConfig, ServedReading
from kvpolicy.analysis.scrape import parse_scrape
from kvpolicy.analysis.served import CACHE_CONFIG_FIELDS, CANARY_CONFIG, ServedSides, differences, served_config
from kvpolicy.api.v1alpha1 import GateVerdict
from operator_helpers import Driver, make_policy

# Lines of a real vLLM 0.32 CPU server's /metrics (labels trimmed): serving with the default KV cache.
REAL_VLLM_METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",kv_cache_dtype_skip_layers="[]"} 1.0
"""


def _at_ready_canary() -> Driver:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 120}))
    driver.tick()
    assert driver.phase == "CanaryStarting"
    driver.world.canary_up()
    return driver


def test_skip_layers_label_is_parsed_as_vllm_writes_it() -> None:
    labels = {"cache_dtype": "fp8", "kv_cache_dtype_skip_layers": "['0', '31']"}
    assert served_config(labels) == ServedConfig("fp8", ("0", "31"))
    assert served_config({"cache_dtype": "auto", "kv_cache_dtype_skip_layers": "[]"}) == ServedConfig("auto", ())


def test_a_real_vllm_scrape_says_what_it_serves() -> None:
    scrape = parse_scrape(REAL_VLLM_METRICS, at=0.0)
    assert scrape.served == ServedConfig("auto", ())


def test_a_canary_serving_the_plan_is_verified_and_status_shows_what_it_serves() -> None:
    driver = _at_ready_canary()
    planned = driver.policy.status.plan
    assert planned is not None and planned.vllm_kv_cache_dtype == "fp8"
    served = ServedReading(configs=(ServedConfig("fp8", tuple(reversed(planned.skip_layers))),))
    driver.tick(canary_served=served)
    assert driver.phase != "CanaryStarting" and driver.phase != "RollingBack"
    assert driver.condition("CanaryConfigVerified") == ("True", "ServedAsPlanned")
    canary = driver.policy.status.canary
    assert canary is not None and canary.served_kv_cache_dtype == "fp8"
    assert sorted(canary.served_skip_layers or []) == sorted(planned.skip_layers)
    assert "CanaryConfigVerified" in driver.reasons()


def test_a_canary_serving_another_kv_dtype_rolls_back_saying_planned_and_served() -> None:
    driver = _at_ready_canary()
    planned = driver.policy.status.plan
    assert planned is not None
    driver.tick(canary_served=ServedReading(configs=(ServedConfig("auto", tuple(planned.skip_layers)),)))
    assert driver.phase == "RollingBack"
    decision = driver.policy.status.decision
    assert decision is not None and decision.reason == "CanaryConfigMismatch"
    assert "planned KV cache dtype fp8" in decision.message and "serves KV cache dtype auto" in decision.message
    assert driver.condition("CanaryConfigVerified") == ("False", "CanaryConfigMismatch")
    assert not any(name for name in driver.world.jobs), "no gate Job runs for a canary that serves something else"


def test_a_canary_missing_the_planned_skip_layers_rolls_back() -> None:
    driver = _at_ready_canary()
    driver.tick(canary_served=ServedReading(configs=(ServedConfig("fp8", ("0", "1", "2")),)))
    decision = driver.policy.status.decision
    assert decision is not None and decision.reason == "CanaryConfigMismatch"
    assert "skip layers [0, 1, 2]" in decision.message


def test_no_served_config_yet_waits_then_rolls_back_at_the_progress_deadline() -> None:
    driver = _at_ready_canary()
    missing = ServedReading(missing="Prometheus at http://prom:9090 has no vllm:cache_config_info of the canary")
    driver.tick(canary_served=missing)
    assert driver.phase == "CanaryStarting"
    assert driver.condition("CanaryConfigVerified") == ("Unknown", "AwaitingServedConfig")
    driver.tick(60, canary_served=missing)
    assert driver.phase == "CanaryStarting"
    driver.tick(61, canary_served=missing)
    assert driver.phase == "RollingBack"
    decision = driver.policy.status.decision
    assert decision is not None and decision.reason == "ProgressDeadlineExceeded"
    assert "could not be verified within 120 s" in decision.message and "Prometheus" in decision.message


def test_served_config_arriving_late_is_verified() -> None:
    driver = _at_ready_canary()
    driver.tick(canary_served=ServedReading(missing="no ready pod to read at their /metrics"))
    assert driver.phase == "CanaryStarting"
    planned = driver.policy.status.plan
    assert planned is not None
    driver.tick(30, canary_served=ServedReading(configs=(ServedConfig("fp8", tuple(planned.skip_layers)),)))
    assert driver.condition("CanaryConfigVerified") == ("True", "ServedAsPlanned")
    assert driver.phase not in ("CanaryStarting", "RollingBack")


# ----------------------------------------------------------------------- parity with the target's own pods


def served_config_of(metrics: str) -> ServedConfig:
    served = parse_scrape(metrics, at=0.0).served
    assert served is not None
    return served


# vllm:cache_config_info of a real vLLM 0.32.0 CPU server (a full scrape, 2026-11-30): every CacheConfig field is a
# label, read here through the scrape provider's own parser.
REAL_CACHE_CONFIG = (
    "vllm:cache_config_info{"
    '_block_size_resolved="True",block_size="128",cache_dtype="auto",cache_hit_alignment_tokens="None",'
    'effective_attention_block_size="128",enable_mamba_shared_prefix_checkpoint="False",'
    'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",'
    'is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",'
    'kv_cache_max_concurrency="64.0",kv_cache_memory_bytes="2147483648",kv_cache_size_tokens="2097152",'
    'kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",'
    'mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",'
    'mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",'
    'num_gpu_blocks="16384",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",'
    'use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"'
    "} 1.0\n"
)
REAL_LABELS = dict(served_config_of(REAL_CACHE_CONFIG).labels)


def _reading(*pods: dict[str, str]) -> ServedReading:
    return ServedReading(configs=tuple(served_config(labels) for labels in pods))


def _canary_labels(planned_skip: list[str], **changes: str) -> dict[str, str]:
    """The real labels as a fair FP8 canary serves them: the planned KV cache, twice the blocks, and `changes`."""
    return {
        **REAL_LABELS,
        "cache_dtype": "fp8",
        "kv_cache_dtype_skip_layers": str(planned_skip),
        "num_gpu_blocks": "32768",
        "kv_cache_size_tokens": "4194304",
        "kv_cache_max_concurrency": "128.0",
        **changes,
    }


def _assess(canary: ServedReading, baseline: ServedReading) -> Verdict:
    driver = _at_ready_canary()
    return CANARY_CONFIG.assess(driver.policy, ServedSides(canary, baseline))


def test_the_real_label_set_is_vllms() -> None:
    assert len(REAL_LABELS) == 37 and REAL_LABELS["enable_prefix_caching"] == "True"


def test_only_the_kv_cache_and_its_sizes_differing_passes() -> None:
    driver = _at_ready_canary()
    assert driver.policy.status.plan is not None
    skip = list(driver.policy.status.plan.skip_layers)
    verdict = _assess(_reading(_canary_labels(skip)), _reading(REAL_LABELS))
    assert verdict.kind is GateVerdict.PASS, verdict.message


def test_one_label_differing_is_a_mismatch_naming_it_and_both_values() -> None:
    driver = _at_ready_canary()
    assert driver.policy.status.plan is not None
    skip = list(driver.policy.status.plan.skip_layers)
    verdict = _assess(_reading(_canary_labels(skip, enable_prefix_caching="False")), _reading(REAL_LABELS))
    assert verdict.kind is GateVerdict.BREACH and verdict.reason == "CanaryConfigMismatch"
    assert "enable_prefix_caching is False on the canary, True on the target" in verdict.message
    assert "num_gpu_blocks" not in verdict.message


def test_prometheus_target_labels_and_the_engine_index_are_not_configuration() -> None:
    driver = _at_ready_canary()
    assert driver.policy.status.plan is not None
    skip = list(driver.policy.status.plan.skip_layers)
    baseline = _reading(
        {**REAL_LABELS, "pod": "llm-a", "instance": "10.0.0.1:8000", "pod_template_hash": "7572cbf64b"},
        {**REAL_LABELS, "pod": "llm-b", "instance": "10.0.0.2:8000", "pod_template_hash": "7572cbf64b"},
    )
    canary = _reading(
        _canary_labels(
            skip, pod="llm-kv-canary-x", instance="10.0.0.3:8000", pod_template_hash="11144b3c24", engine="1"
        )
    )
    assert _assess(canary, baseline).kind is GateVerdict.PASS


def test_a_label_on_one_side_only_is_not_compared() -> None:
    """Another vLLM release (the patched image) may have other CacheConfig fields: nothing to compare them with."""
    driver = _at_ready_canary()
    assert driver.policy.status.plan is not None
    skip = list(driver.policy.status.plan.skip_layers)
    canary = {key: value for key, value in _canary_labels(skip, new_field="1").items() if key != "use_replayssm"}
    assert _assess(_reading(canary), _reading(REAL_LABELS)).kind is GateVerdict.PASS


def test_block_sizes_differ_only_when_the_plan_names_a_backend() -> None:
    labels = {**REAL_LABELS, "cache_dtype": "fp8", "block_size": "16"}
    assert differences([served_config(labels)], [served_config(REAL_LABELS)], backend_planned=True) == []
    (found,) = differences([served_config(labels)], [served_config(REAL_LABELS)], backend_planned=False)
    assert found.describe() == "block_size is 16 on the canary, 128 on the target"


def test_no_baseline_reading_waits() -> None:
    driver = _at_ready_canary()
    assert driver.policy.status.plan is not None
    skip = list(driver.policy.status.plan.skip_layers)
    verdict = _assess(_reading(_canary_labels(skip)), ServedReading(missing="no ready pod to read at their /metrics"))
    assert verdict.kind is GateVerdict.NO_DATA and verdict.reason == "AwaitingServedConfig"
    assert verdict.message == "the target's own pods: no ready pod to read at their /metrics"


def test_a_canary_differing_from_its_target_rolls_back_naming_the_label() -> None:
    driver = _at_ready_canary()
    planned = driver.policy.status.plan
    assert planned is not None
    canary = _reading(_canary_labels(list(planned.skip_layers), gpu_memory_utilization="0.8"))
    driver.tick(canary_served=canary, baseline_served=_reading(REAL_LABELS))
    assert driver.phase == "RollingBack"
    decision = driver.policy.status.decision
    assert decision is not None and decision.reason == "CanaryConfigMismatch"
    assert "gpu_memory_utilization is 0.8 on the canary, 0.92 on the target" in decision.message


def test_a_field_the_targets_pods_disagree_on_is_not_compared() -> None:
    baseline = [served_config(REAL_LABELS), served_config({**REAL_LABELS, "gpu_memory_utilization": "0.8"})]
    canary = [served_config({**REAL_LABELS, "gpu_memory_utilization": "0.7", "enable_prefix_caching": "False"})]
    (found,) = differences(canary, baseline, backend_planned=True)
    assert found.label == "enable_prefix_caching"


def test_the_compared_fields_are_vllms_cache_config() -> None:
    cache = pytest.importorskip("vllm.config.cache", reason="vLLM is not installed")
    assert set(cache.CacheConfig().metrics_info()) == CACHE_CONFIG_FIELDS
    assert set(REAL_LABELS) - {"engine"} == CACHE_CONFIG_FIELDS
