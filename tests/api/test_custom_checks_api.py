"""Admission of spec.analysis (custom checks and the selector template): pydantic refuses what the CRD's CEL rules
refuse, with the same message, and the README's example is a valid policy."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from kvpolicy.api import crd
from kvpolicy.api.v1alpha1 import AnalysisSpec, CustomCheck, KVPolicySpec
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-h100-128k.yaml").read_text())["spec"]
QUERY = "sum(rate(vllm:request_queue_time_seconds_sum{ {{ canary }} }[{{ window }}]))"
PROMETHEUS = {"provider": "Prometheus", "prometheusURL": "http://prometheus:9090"}


def _rules(node: Any) -> Iterator[tuple[str, str]]:
    """(rule, message) of every x-kubernetes-validations entry under a schema node."""
    if isinstance(node, dict):
        for entry in node.get("x-kubernetes-validations", []):
            yield entry["rule"], entry["message"]
        for value in node.values():
            yield from _rules(value)
    elif isinstance(node, list):
        for value in node:
            yield from _rules(value)


def _cel_refuses(message: str, value: Any) -> bool:
    """Whether the CRD's rule carrying `message` refuses `value` (the object the rule sits on)."""
    schema = crd.crd_object()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    # A set: Bounds' rules sit under both range and baselineRatio.
    [rule] = {rule for rule, said in _rules(schema) if said == message}
    env = celpy.Environment()
    return not bool(env.program(env.compile(rule)).evaluate(celpy.json_to_cel({"self": value})))


def _check(**fields: Any) -> dict[str, Any]:
    return {"name": "queue", "query": QUERY, "range": {"max": "0.5"}, **fields}


def _spec(analysis: dict[str, Any], **latency: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec.setdefault("gates", {}).setdefault("latency", {}).update(PROMETHEUS | latency)
    spec["analysis"] = analysis
    return spec


# (the custom check, the message pydantic and the CRD both give)
BAD_CHECKS = [
    (_check(query="sum(rate(vllm:request_queue_time_seconds_sum[5m]))"), "must contain the {{ canary }} placeholder"),
    (_check(query=QUERY + " / {{ target }}"), "may use only the placeholders {{ canary }}, {{ baseline }}"),
    (_check(query=QUERY.replace("{{ canary }}", "{{canary}}") + " {{ canary }}"), "may use only the placeholders"),
    ({"name": "queue", "query": QUERY}, "a custom check needs range, baselineRatio or both"),
]


@pytest.mark.parametrize(("check", "message"), BAD_CHECKS, ids=[m[:40] for _, m in BAD_CHECKS])
def test_bad_custom_checks_are_refused_by_pydantic_and_by_cel(check: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        CustomCheck.model_validate(check)
    [full] = {said for _, said in _rules(crd.crd_object()) if message in said}
    assert _cel_refuses(full, check)
    good = _check()
    CustomCheck.model_validate(good)
    assert not _cel_refuses(full, good)


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({}, "a custom check's range needs min, max or both"),
        ({"min": "2", "max": "1.5"}, 'a custom check\'s range must have min <= max (got min "2" and max "1.5")'),
    ],
)
def test_ranges_need_a_bound_and_min_at_most_max(bounds: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        CustomCheck.model_validate(_check(range=bounds))
    assert _cel_refuses(message.split(" (got")[0], bounds)
    assert not _cel_refuses(message.split(" (got")[0], {"min": "1", "max": "1"})


def test_thresholds_are_decimal_strings_never_floats() -> None:
    with pytest.raises(ValidationError, match="valid string"):
        CustomCheck.model_validate(_check(range={"max": 0.5}))
    with pytest.raises(ValidationError, match="should match pattern"):
        CustomCheck.model_validate(_check(range={"max": "1e-3"}))


ANALYSIS_REFUSALS = [
    ({"checks": [_check(), _check()]}, {}, "analysis.checks must have unique names"),
    ({"selectorTemplate": 'namespace="$ns", pod=~"$pod_regex"'}, {}, "may use only $namespace, $pod_regex"),
    ({"selectorTemplate": 'namespace="$namespace"'}, {}, "must tell the canary's pods from the baseline's"),
    ({"checks": [_check()]}, {"provider": "Scrape"}, "analysis.checks need gates.latency.provider Prometheus"),
    ({"checks": [_check()]}, {"enabled": False}, "ReplicaRatio or InferencePool and gates.latency.enabled"),
]


@pytest.mark.parametrize(("analysis", "latency", "message"), ANALYSIS_REFUSALS, ids=[m for *_, m in ANALYSIS_REFUSALS])
def test_bad_analysis_specs_are_refused_by_pydantic_and_by_cel(
    analysis: dict[str, Any], latency: dict[str, Any], message: str
) -> None:
    spec = _spec(analysis, **latency)
    with pytest.raises(ValidationError, match=re.escape(message)):
        KVPolicySpec.model_validate(spec)
    [full] = {said for _, said in _rules(crd.crd_object()) if message in said}
    spec_level = full.startswith("analysis.checks need") or full.startswith("analysis.checks run")
    assert _cel_refuses(full, spec if spec_level else analysis)


def test_custom_checks_with_synthetic_traffic_are_refused() -> None:
    spec = _spec({"checks": [_check()]})
    spec.setdefault("rollout", {})["traffic"] = "Synthetic"
    with pytest.raises(ValidationError, match=re.escape("they need rollout.traffic ReplicaRatio")):
        KVPolicySpec.model_validate(spec)
    assert _cel_refuses(
        "analysis.checks run in the live latency analysis: they need rollout.traffic ReplicaRatio or InferencePool "
        "and gates.latency.enabled",
        spec,
    )


def test_custom_checks_run_on_the_live_analysis_of_an_inference_pool_rollout() -> None:
    spec = _spec({"checks": [_check()]})
    spec.setdefault("rollout", {})["traffic"] = "InferencePool"
    spec["rollout"]["inferencePool"] = {"httpRoute": "llm", "pool": "llama"}
    KVPolicySpec.model_validate(spec)
    assert not _cel_refuses(
        "analysis.checks run in the live latency analysis: they need rollout.traffic ReplicaRatio or InferencePool "
        "and gates.latency.enabled",
        spec,
    )


def test_selector_templates_the_provider_understands_are_admitted() -> None:
    for template in ('namespace="$namespace", pod=~"$pod_regex"', '$labels, role="${role}"', 'a="$$x", $labels'):
        AnalysisSpec.model_validate({"selectorTemplate": template})
        assert not _cel_refuses(
            "analysis.selectorTemplate may use only $namespace, $pod_regex, $labels and $role ($$ for a dollar sign)",
            {"selectorTemplate": template},
        )


def test_the_readme_example_is_a_valid_policy() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Custom checks", 1)[1]
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])["spec"]
    spec = copy.deepcopy(BASE)
    for key, value in example.items():
        spec[key] = {**spec.get(key, {}), **value} if key != "analysis" else value
    spec["gates"]["latency"] = {**BASE.get("gates", {}).get("latency", {}), **example["gates"]["latency"]}
    validated = KVPolicySpec.model_validate(spec)
    assert validated.analysis is not None and [check.name for check in validated.analysis.checks] == [
        "abort-ratio",
        "queue-time",
    ]
    for check in spec["analysis"]["checks"]:
        for _, message in _rules(crd.crd_object()):
            if message.startswith("a custom check's query"):
                assert not _cel_refuses(message, check)
