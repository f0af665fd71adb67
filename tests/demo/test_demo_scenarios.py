"""The embedded scenarios set up exactly the six situations issue 8 asks the demo to show."""

from __future__ import annotations

import pytest
from kvpolicy.api.v1alpha1 import KVPolicySpec, Plan
from kvpolicy.planning.gpu import gpu_facts
from kvpolicy.planning.planner import plan
from kvpolicy_dev.demo import scenarios


def _plan_for(scenario: scenarios.Scenario) -> tuple[KVPolicySpec, Plan]:
    spec = KVPolicySpec.model_validate(scenarios.kvpolicy(scenario, scenarios.DEMO_TIMING, prometheus_url=None)["spec"])
    pool = scenarios.pool(scenario.pool)
    return spec, plan(spec, gpu_facts([node["metadata"]["labels"] for node in pool.node_objects()]))


def _scenario(name: str) -> scenarios.Scenario:
    return next(s for s in scenarios.SCENARIOS if s.name == name)


@pytest.mark.parametrize(
    ("name", "dtype", "image", "skip_layers", "reason"),
    [
        # The planner trusts the declared feature: only the accuracy gate can expose the mislabelled image.
        ("llama-longdoc-unfixed", "FP8", scenarios.MISLABELLED_IMAGE, [], "TwoLevelAccumulationImage"),
        ("llama-longdoc", "FP8", scenarios.FIXED_IMAGE, [], "TwoLevelAccumulationImage"),
        # Blackwell needs no patched image: the canary runs the target's own (the plan names none).
        ("llama-longdoc-b200", "FP8", None, [], "BlackwellNoFixNeeded"),
        ("support-chat", "BF16", scenarios.BASELINE_IMAGE, [], "BelowDecodeBreakEven"),
        ("gemma-ttft", "BF16", scenarios.BASELINE_IMAGE, [], "HeadDim256PrefillPenalty"),
        ("gpt-oss-20b", "FP8", scenarios.FIXED_IMAGE, ["sliding_window"], "SkipSlidingWindowLayers"),
    ],
)
def test_each_scenario_plans_what_the_issue_asks(
    name: str, dtype: str, image: str | None, skip_layers: list[str], reason: str
) -> None:
    _, result = _plan_for(_scenario(name))
    assert result.kv_cache_dtype.value == dtype
    assert result.image == image
    assert result.skip_layers == skip_layers
    assert reason in [r.code for r in result.reasons]


def test_fp8_scenarios_run_both_gates_with_the_demo_timing() -> None:
    for scenario in scenarios.SCENARIOS:
        spec, result = _plan_for(scenario)
        if result.is_fp8:
            assert result.gates == ["Accuracy", "Latency"]
        assert spec.rollout.bake_seconds == scenarios.DEMO_TIMING.bake_seconds
        assert spec.gates.accuracy.max_samples == scenarios.DEMO_TIMING.accuracy_max_samples


def test_latency_provider_follows_prometheus_availability() -> None:
    scenario = scenarios.SCENARIOS[0]
    scrape = scenarios.kvpolicy(scenario, scenarios.FAST_TIMING, prometheus_url=None)["spec"]["gates"]["latency"]
    assert scrape["provider"] == "Scrape" and "prometheusURL" not in scrape
    url = "http://127.0.0.1:9090"
    prom = scenarios.kvpolicy(scenario, scenarios.FAST_TIMING, prometheus_url=url)["spec"]["gates"]["latency"]
    assert (prom["provider"], prom["prometheusURL"]) == ("Prometheus", url)
    # The scenario's own thresholds survive the runtime overrides.
    assert prom["ttftMaxRatio"] == "1.10"


def test_deployments_select_their_pool_and_serve_the_policy_model() -> None:
    for scenario in scenarios.SCENARIOS:
        deployment = scenarios.deployment(scenario)
        pod = deployment["spec"]["template"]
        assert pod["spec"]["nodeSelector"] == {scenarios.POOL_LABEL: scenario.pool}
        container = pod["spec"]["containers"][0]
        assert container["command"] == ["vllm", "serve"]
        assert container["args"][0] == scenario.served_model_name
        assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
        assert scenarios.service(scenario)["spec"]["selector"] == pod["metadata"]["labels"]


def test_names_are_unique_and_every_pool_has_nodes() -> None:
    names = [s.name for s in scenarios.SCENARIOS]
    assert len(set(names)) == len(names)
    pools = {pool.name: pool for pool in scenarios.node_pools()}
    for scenario in scenarios.SCENARIOS:
        assert pools[scenario.pool].nodes >= 1 and pools[scenario.pool].gpu_product is not None


def test_unknown_pool_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="no node pool named 'tpu'"):
        scenarios.pool("tpu")
