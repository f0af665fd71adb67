"""Custom checks (spec.analysis.checks): the pure assessor, and the checks evaluated against a real Prometheus
(Debian's binary) scraping simulator processes (the session's `fleet`)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvpolicy.analysis.checks import Sides, combine
from kvpolicy.analysis.custom import CustomReading, assess_custom, custom_checks, render_query
from kvpolicy.analysis.model import SideSelector, Verdict
from kvpolicy.analysis.prometheus import PrometheusProvider
from kvpolicy.api.v1alpha1 import CustomCheck, GateVerdict, KVPolicy
from kvpolicy.kube.observe import LatencyAnalyser
from live_fleet import Fleet

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-h100-128k.yaml").read_text())["spec"]
MEAN_TTFT = (
    "sum(rate(vllm:time_to_first_token_seconds_sum{ {{ canary }} }[{{ window }}])) "
    "/ sum(rate(vllm:time_to_first_token_seconds_count{ {{ canary }} }[{{ window }}]))"
)
ABORT_RATIO = (
    '(sum(increase(vllm:request_success_total{ {{ canary }}, finished_reason="abort" }[{{ window }}])) or vector(0)) '
    "/ sum(increase(vllm:request_success_total{ {{ canary }} }[{{ window }}]))"
)

# A window long enough to hold everything the session's Prometheus has seen.
WINDOW = 600


def check(**fields: Any) -> CustomCheck:
    return CustomCheck.model_validate({"name": "c", "query": MEAN_TTFT, **fields})


# ------------------------------------------------------------------------------------------------ pure assessor


def test_a_value_inside_its_range_passes_and_is_kept() -> None:
    verdict = assess_custom(check(range={"min": "0.1", "max": "0.5"}), CustomReading(0.5))
    assert (verdict.kind, verdict.reason) == (GateVerdict.PASS, "WithinThresholds")
    assert verdict.values == {"c": 0.5} and "canary value 0.5" in verdict.message


@pytest.mark.parametrize(("value", "said"), [(0.51, "above max 0.5"), (0.09, "below min 0.1")])
def test_a_value_outside_its_range_breaches_naming_the_bound(value: float, said: str) -> None:
    verdict = assess_custom(check(range={"min": "0.1", "max": "0.5"}), CustomReading(value))
    assert (verdict.kind, verdict.reason) == (GateVerdict.BREACH, "CustomCheckBreached")
    assert verdict.message == f"custom check c: canary value {value:.4g} is {said}"


def test_the_canary_baseline_ratio_is_held_to_its_range() -> None:
    ratio_only = check(baselineRatio={"max": "1.2"})
    passed = assess_custom(ratio_only, CustomReading(0.11, 0.1))
    assert passed.kind is GateVerdict.PASS and passed.values == {"c": 0.11, "c_ratio": 1.1}
    breached = assess_custom(ratio_only, CustomReading(0.15, 0.1))
    assert breached.kind is GateVerdict.BREACH
    assert breached.message == "custom check c: canary/baseline 0.15/0.1 = 1.500x is above max 1.2"
    both = assess_custom(check(range={"max": "0.1"}, baselineRatio={"max": "1.2"}), CustomReading(0.15, 0.1))
    assert both.message.count(";") == 1 and "above max 0.1" in both.message


@pytest.mark.parametrize(
    ("reading", "said"),
    [
        (CustomReading(None), "returned no series (or NaN) for the canary"),
        (CustomReading(0.2, None), "returned no series (or NaN) for the baseline"),
        (CustomReading(0.2, 0.0), "returned 0, so no ratio for the baseline"),
    ],
)
def test_missing_values_are_no_data_never_a_pass_or_a_breach(reading: CustomReading, said: str) -> None:
    verdict = assess_custom(check(range={"max": "0.1"}, baselineRatio={"max": "1.2"}), reading)
    assert (verdict.kind, verdict.reason) == (GateVerdict.NO_DATA, "CustomCheckNoData")
    assert said in verdict.message


def test_placeholders_are_filled_per_side() -> None:
    query = "x{ {{ canary }} } / y{ {{ baseline }} }[{{ window }}]"
    assert render_query(query, 'pod="a"', 'pod="b"', 300) == 'x{ pod="a" } / y{ pod="b" }[300s]'


def test_verdicts_made_together_speak_by_severity() -> None:
    passed = Verdict(GateVerdict.PASS, "WithinThresholds", "ttft fine")
    no_data = Verdict(GateVerdict.NO_DATA, "CustomCheckNoData", "no data", values={"q": 1.0})
    breach = Verdict(GateVerdict.BREACH, "CustomCheckBreached", "too slow", values={"e": 0.2})
    assert combine([passed]) is passed
    assert combine([passed, no_data]).reason == "CustomCheckNoData"
    both = combine([passed, no_data, breach])
    assert (both.kind, both.reason, both.message) == (GateVerdict.BREACH, "CustomCheckBreached", "too slow")
    assert both.values == {"q": 1.0, "e": 0.2}
    all_pass = combine([passed, Verdict(GateVerdict.PASS, "WithinThresholds", "custom fine")])
    assert all_pass.kind is GateVerdict.PASS and all_pass.message == "ttft fine; custom fine"


# --------------------------------------------------------------------------------------------- real Prometheus


def policy(url: str, *checks: dict[str, Any], selector_template: str | None = None) -> KVPolicy:
    spec = copy.deepcopy(BASE)
    spec.setdefault("gates", {})["latency"] = {"provider": "Prometheus", "prometheusURL": url, "windowSeconds": WINDOW}
    spec["analysis"] = {"checks": list(checks)}
    if selector_template is not None:
        spec["analysis"]["selectorTemplate"] = selector_template
    return KVPolicy.model_validate({"metadata": {"name": "p", "namespace": "llm"}, "spec": spec})


def sides(canary: str, window_seconds: int = WINDOW) -> Sides:
    return Sides(
        SideSelector("canary", "llm", pods=(canary,)),
        SideSelector("baseline", "llm", pods=("m-baseline-0",)),
        window_seconds,
    )


async def evaluate(fleet: Fleet, canary: str, *checks: dict[str, Any], template: str | None = None) -> list[Verdict]:
    analysed = policy(fleet.prometheus.url, *checks, selector_template=template)
    analyser = LatencyAnalyser()
    try:
        provider = await analyser.provider(analysed)
        return [await entry.evaluate(provider, analysed, sides(canary)) for entry in custom_checks(analysed)]
    finally:
        await analyser.close()


@pytest.mark.prometheus
async def test_a_custom_ratio_check_on_real_series(fleet: Fleet) -> None:
    slower = {"name": "mean-ttft", "query": MEAN_TTFT, "baselineRatio": {"max": "1.2"}}
    [breach] = await evaluate(fleet, "m-slow-0", slower)  # the simulator 1.5x slower
    assert (breach.kind, breach.reason) == (GateVerdict.BREACH, "CustomCheckBreached"), breach
    assert breach.values["mean-ttft_ratio"] == pytest.approx(1.5, rel=0.05)
    [passed] = await evaluate(fleet, "m-canary-0", slower)
    assert (passed.kind, passed.reason) == (GateVerdict.PASS, "WithinThresholds"), passed
    assert passed.values["mean-ttft_ratio"] == pytest.approx(1.0, rel=0.05)
    assert 0.02 < passed.values["mean-ttft"] < 0.2, "the simulator's TTFT at this prompt length is ~48 ms"


@pytest.mark.prometheus
async def test_an_error_ratio_check_and_a_configured_selector_template(fleet: Fleet) -> None:
    aborts = {"name": "aborts", "query": ABORT_RATIO, "range": {"max": "0.01"}}
    [verdict] = await evaluate(fleet, "m-canary-0", aborts, template='pod=~"$pod_regex"')
    assert (verdict.kind, verdict.values) == (GateVerdict.PASS, {"aborts": 0.0}), verdict
    [unmatched] = await evaluate(fleet, "m-canary-0", aborts, template='pod=~"$pod_regex", namespace="elsewhere"')
    assert (unmatched.kind, unmatched.reason) == (GateVerdict.NO_DATA, "CustomCheckNoData"), unmatched


@pytest.mark.prometheus
async def test_no_series_is_no_data(fleet: Fleet) -> None:
    drafts = "sum(vllm:spec_decode_num_drafts_total{ {{ canary }} })"  # no speculative decoding here
    missing = {"name": "spec-decode", "query": drafts, "range": {"min": "1"}}
    idle_ttft = {"name": "mean-ttft", "query": MEAN_TTFT, "range": {"max": "1"}}
    verdicts = await evaluate(fleet, "m-canary-0", missing)
    verdicts += await evaluate(fleet, "m-idle-0", idle_ttft)  # served nothing: 0/0 is NaN
    for verdict in verdicts:
        assert (verdict.kind, verdict.reason) == (GateVerdict.NO_DATA, "CustomCheckNoData"), verdict


@pytest.mark.prometheus
async def test_a_query_prometheus_rejects_is_a_clear_provider_verdict(fleet: Fleet) -> None:
    broken = {"name": "broken", "query": "sum(rate(vllm:x{ {{ canary }} }[{{ window }}])", "range": {"max": "1"}}
    series = {
        "name": "per-bucket",
        "query": "count by (le) (vllm:time_to_first_token_seconds_bucket{ {{ canary }} })",
        "range": {"max": "1000"},
    }
    rejected, several = await evaluate(fleet, "m-canary-0", broken, series)
    for verdict in (rejected, several):
        assert (verdict.kind, verdict.reason) == (GateVerdict.PROVIDER_UNAVAILABLE, "CustomCheckQueryRejected")
        assert verdict.needs_attention and verdict.message.startswith("custom check ")
    assert "HTTP 400" in rejected.message and "bad_data" in rejected.message, rejected.message
    assert "series; aggregate it to one" in several.message, several.message


async def test_custom_checks_need_the_prometheus_provider() -> None:
    scraped = policy("http://127.0.0.1:9", {"name": "c", "query": MEAN_TTFT, "range": {"max": "1"}})
    scraped = scraped.model_copy(update={"spec": scraped.spec.model_copy(update={"gates": type(scraped.spec.gates)()})})
    analyser = LatencyAnalyser()
    [entry] = custom_checks(scraped)
    verdict = await entry.evaluate(await analyser.provider(scraped), scraped, sides("m-canary-0"))
    await analyser.close()
    assert (verdict.kind, verdict.reason) == (GateVerdict.PROVIDER_UNAVAILABLE, "CustomCheckNeedsPrometheus")


async def test_the_selector_template_in_the_spec_is_the_one_the_provider_uses() -> None:
    analyser = LatencyAnalyser()
    try:
        analysed = policy("http://prometheus:9090", selector_template='kubernetes_pod_name=~"$pod_regex"')
        provider = await analyser.provider(analysed)
        assert isinstance(provider, PrometheusProvider)
        assert provider.matchers(SideSelector("canary", "llm", pods=("a0",))) == 'kubernetes_pod_name=~"a0"'
        default = await analyser.provider(policy("http://prometheus:9090"))
        assert isinstance(default, PrometheusProvider) and default is not provider
        assert default.matchers(SideSelector("canary", "llm", pods=("a",))) == 'namespace="llm", pod=~"a"'
    finally:
        await analyser.close()
