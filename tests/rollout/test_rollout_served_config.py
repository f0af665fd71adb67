"""The canary really runs what the plan says: its own vllm:cache_config_info against the plan, before any gate."""

from __future__ import annotations

from kvpolicy.analysis.provider import ServedConfig, ServedReading
from kvpolicy.analysis.scrape import parse_scrape
from kvpolicy.analysis.served import served_config
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
