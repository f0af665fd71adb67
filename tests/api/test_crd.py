"""The CRD generated from the pydantic models: fresh on disk, structural, and its CEL rules agree with pydantic."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from kvpolicy.api import crd
from kvpolicy.api.v1alpha1 import KVPolicySpec
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _schema() -> dict[str, Any]:
    version = crd.crd_object()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from _walk(value, f"{path}.{key}")
        if "items" in node:
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_crd_file_is_generated_from_the_models() -> None:
    on_disk = (ROOT / "crds" / "kvpolicy.yaml").read_text(encoding="utf-8")
    assert on_disk == crd.render(), "crds/kvpolicy.yaml is stale: run `kvpolicy crd -o crds/kvpolicy.yaml`"


def test_cli_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert crd.main([]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == crd.crd_object()


def test_schema_is_structural() -> None:
    for path, node in _walk(_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert forbidden not in node, f"{path} uses {forbidden}"
    preserved = [p for p, n in _walk(_schema()) if n.get("x-kubernetes-preserve-unknown-fields")]
    assert preserved == [".status.kopf"]


def test_crd_names_columns_and_subresources() -> None:
    spec = crd.crd_object()["spec"]
    assert spec["names"]["shortNames"] == ["kvp"]
    assert spec["names"]["plural"] == "kvpolicies"
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "KV",
        "GPU",
        "Decision",
        "Reason",
        "Age",
        "Planned",
    ]


def test_kv_column_shows_what_the_target_serves_not_the_plan() -> None:
    """A rolled-back FP8 plan: the KV column reads BF16 (the target's dtype), the wide-only Planned column FP8."""
    from kvpolicy_dev.devcluster.tables import PrinterColumn, cell

    columns = {c["name"]: PrinterColumn.from_crd(c) for c in crd.PRINTER_COLUMNS}
    rolled_back = {
        "status": {
            "phase": "RolledBack",
            "plan": {"kvCacheDtype": "FP8"},
            "decision": {"result": "RolledBack", "kvCacheDtype": "BF16"},
        }
    }
    promoted = {"status": {"plan": {"kvCacheDtype": "FP8"}, "decision": {"result": "Promoted", "kvCacheDtype": "FP8"}}}
    now = datetime.datetime.now(datetime.UTC)
    assert cell(rolled_back, columns["KV"], now) == "BF16"
    assert cell(rolled_back, columns["Planned"], now) == "FP8"
    assert cell(promoted, columns["KV"], now) == "FP8"
    assert columns["Planned"].priority == 1  # `kubectl get -o wide` only


def test_no_floats_in_spec() -> None:
    spec_schema = _schema()["properties"]["spec"]
    assert not [p for p, n in _walk(spec_schema) if n.get("type") == "number"]


def _defaulted(document: dict[str, Any]) -> dict[str, Any]:
    """What the API server stores after defaulting: the pydantic model fills the same defaults."""
    return KVPolicySpec.model_validate(document["spec"]).to_k8s()


def _cel_rules() -> list[tuple[str, str, str]]:
    """(path under spec, rule, message) for every x-kubernetes-validations entry in the spec schema."""
    spec_schema = _schema()["properties"]["spec"]
    found = []
    for path, node in _walk(spec_schema):
        for rule in node.get("x-kubernetes-validations", []):
            found.append((path, rule["rule"], rule["message"]))
    return found


def _at(obj: Any, path: str) -> Any:
    for part in [p for p in path.split(".") if p]:
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _evaluate(rule: str, value: Any) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(rule))
    return bool(program.evaluate(celpy.json_to_cel({"self": value})))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd(example: Path) -> None:
    document = yaml.safe_load(example.read_text(encoding="utf-8"))
    assert document["apiVersion"] == "kvpolicy.dev/v1alpha1" and document["kind"] == "KVPolicy"
    jsonschema.validate(document["spec"], _schema()["properties"]["spec"])
    defaulted = _defaulted(document)
    for path, rule, message in _cel_rules():
        value = _at(defaulted, path)
        if value is not None:
            assert _evaluate(rule, value), f"{example.name}: {message}"


BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-h100-128k.yaml").read_text())


def _mutated(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE["spec"])
    *parents, leaf = path.split(".")
    node = spec
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return spec


TOKEN_REF = {"name": "prometheus", "key": "token"}
# (field to set, value, text the error must contain: the field and what to fix)
BAD_SPECS = [
    ("workload.maxContextTokens", 262144, "workload.maxContextTokens must not exceed model.maxModelLen"),
    ("workload.typicalContextTokens", 200000, "typicalContextTokens must not exceed workload.maxContextTokens"),
    ("gates.accuracy.minRecovery", "1.5", "minRecovery must be a number in (0, 1]"),
    ("gates.accuracy.minRecovery", "0", "minRecovery must be a number in (0, 1]"),
    ("gates.accuracy.lengthTokens", 262144, "lengthTokens must not exceed model.maxModelLen"),
    (
        "gates.accuracy",
        {"lengthTokens": 4096, "lengthProfile": {"buckets": 4}},
        "lengthProfile.buckets halves the gate length (lengthTokens, else workload.maxContextTokens) buckets - 1 "
        "times: the shortest bucket must be at least 1024 tokens",
    ),
    ("gates.latency.ttftMaxRatio", "0.0", "ttftMaxRatio and itlMaxRatio must be numbers in (0, 100]"),
    ("gates.latency.quantiles", ["0.5", "1.0"], "quantiles must be numbers in (0, 1)"),
    ("kvCache.scales", "Calibrated", "scalesSource is required when kvCache.scales is Calibrated"),
    ("model.slidingWindow", {"windowTokens": 128}, "set exactly one of slidingWindow.layers"),
    ("model.slidingWindow", {"windowTokens": 128, "layers": [1, 40]}, "layer indices below model.numLayers"),
    ("model.slidingWindow", {"windowTokens": 128, "count": 64}, "slidingWindow.count must not exceed model.numLayers"),
    (
        "gates.latency.prometheusAuth",
        {"bearerTokenSecretRef": TOKEN_REF, "basicAuth": {"username": TOKEN_REF, "password": TOKEN_REF}},
        "prometheusAuth takes bearerTokenSecretRef or basicAuth, not both",
    ),
    ("gates.latency.prometheusAuth", {"tls": {"insecureSkipVerify": True}}, "tls needs an https:// prometheusURL"),
    ("gates.latency.prometheusAuth.tls", {"cert": {"secret": TOKEN_REF}}, "needs both tls.cert and tls.keySecret"),
    (
        "gates.latency.prometheusAuth.tls",
        {"ca": {"secret": TOKEN_REF, "configMap": TOKEN_REF}},
        "set exactly one of secret or configMap",
    ),
]

# (field, value, the whole message with its values: pydantic's and the CRD's messageExpression must both say it)
VALUED_MESSAGES = [
    (
        "workload.maxContextTokens",
        262144,
        "workload.maxContextTokens must not exceed model.maxModelLen (262144 > 131072)",
    ),
    (
        "workload.typicalContextTokens",
        200000,
        "workload.typicalContextTokens must not exceed workload.maxContextTokens (200000 > 131072)",
    ),
    (
        "gates.accuracy.lengthTokens",
        262144,
        "gates.accuracy.lengthTokens must not exceed model.maxModelLen (262144 > 131072)",
    ),
    (
        "gates.accuracy",
        {"lengthTokens": 4096, "lengthProfile": {"buckets": 4}},
        "gates.accuracy.lengthProfile.buckets halves the gate length (lengthTokens, else workload.maxContextTokens) "
        "buckets - 1 times: the shortest bucket must be at least 1024 tokens (4 buckets of 4096 tokens: the shortest "
        "is 512)",
    ),
    (
        "gates.accuracy.minRecovery",
        "1.5",
        'gates.accuracy.minRecovery must be a number in (0, 1], such as "0.95" (got "1.5")',
    ),
    (
        "gates.accuracy.confidence",
        "1",
        'gates.accuracy.confidence must be a number in (0, 1), such as "0.95" (got "1")',
    ),
    (
        "gates.accuracy.baselineFloor",
        "1.0",
        'gates.accuracy.baselineFloor must be a number in [0, 1), such as "0.2" (got "1.0")',
    ),
    (
        "gates.latency",
        {"ttftMaxRatio": "1.10", "itlMaxRatio": "0"},
        'gates.latency.ttftMaxRatio and itlMaxRatio must be numbers in (0, 100], such as "1.10" (got "1.10" and "0")',
    ),
    (
        "gates.latency.quantiles",
        ["0.5", "1.0", "0.99"],
        'gates.latency.quantiles must be numbers in (0, 1), such as "0.95" (got "1.0")',
    ),
    (
        "model.slidingWindow",
        {"windowTokens": 128, "layers": [1, 40, 50]},
        "model.slidingWindow.layers must be layer indices below model.numLayers (40 >= 32)",
    ),
    (
        "model.slidingWindow",
        {"windowTokens": 128, "count": 64},
        "model.slidingWindow.count must not exceed model.numLayers (64 > 32)",
    ),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD_SPECS, ids=[f"{p}={v}" for p, v, _ in BAD_SPECS])
def test_bad_specs_fail_in_pydantic_and_in_cel_with_the_same_message(path: str, value: Any, message: str) -> None:
    spec = _mutated(path, value)
    with pytest.raises(ValidationError) as caught:
        KVPolicySpec.model_validate(spec)
    assert message in str(caught.value)
    # The API server would reject it with the same message: find the CEL rule carrying it and evaluate it.
    failing = [(p, r) for p, r, m in _cel_rules() if message in m]
    assert failing, f"no CEL rule carries {message!r}"
    rule_path, rule = failing[0]
    assert not _evaluate(rule, _at(spec, rule_path) if rule_path else spec)


def _message_expression(rule: str) -> str:
    """The messageExpression of the CRD's rule `rule` (every rule that names values has one)."""
    spec_schema = _schema()["properties"]["spec"]
    for _, node in _walk(spec_schema):
        for entry in node.get("x-kubernetes-validations", []):
            if entry["rule"] == rule:
                return str(entry["messageExpression"])
    raise AssertionError(f"no rule {rule}")


@pytest.mark.parametrize(("path", "value", "message"), VALUED_MESSAGES, ids=[p for p, _, _ in VALUED_MESSAGES])
def test_messages_name_the_offending_values_in_pydantic_and_in_cel(path: str, value: Any, message: str) -> None:
    spec = _mutated(path, value)
    with pytest.raises(ValidationError) as caught:
        KVPolicySpec.model_validate(spec)
    assert message in str(caught.value)
    static = message.rsplit(" (", 1)[0]
    [(rule_path, rule)] = [(p, r) for p, r, m in _cel_rules() if m == static]
    env = celpy.Environment()
    expression = env.program(env.compile(_message_expression(rule)))
    scope = _at(spec, rule_path) if rule_path else spec
    assert str(expression.evaluate(celpy.json_to_cel({"self": scope}))) == message


PROFILE_RULE = "the shortest bucket must be at least 1024 tokens"


@pytest.mark.parametrize(
    ("length_tokens", "buckets", "valid"),
    [(None, 3, True), (None, 4, False), (None, 1, True), (2048, 2, True), (2048, 3, False), (131072, 6, True)],
)
def test_the_shortest_profile_bucket_follows_the_gates_length_in_pydantic_and_in_cel(
    length_tokens: int | None, buckets: int, valid: bool
) -> None:
    # workload.maxContextTokens 4096 is the gate's length unless lengthTokens says otherwise.
    spec = _mutated("workload", {"maxContextTokens": 4096, "typicalContextTokens": 1024})
    spec["gates"]["accuracy"]["lengthProfile"] = {"buckets": buckets}
    if length_tokens is not None:
        spec["gates"]["accuracy"]["lengthTokens"] = length_tokens
        spec["workload"]["maxContextTokens"] = spec["model"]["maxModelLen"] = max(length_tokens, 4096)
    [(rule_path, rule)] = [(p, r) for p, r, m in _cel_rules() if PROFILE_RULE in m]
    assert _evaluate(rule, _at(spec, rule_path) if rule_path else spec) == valid
    if valid:
        KVPolicySpec.model_validate(spec)
    else:
        with pytest.raises(ValidationError, match=PROFILE_RULE):
            KVPolicySpec.model_validate(spec)


# Strict types and 64-bit integers: the API server refuses these, so pydantic must not coerce them.
STRICT_TYPES = [
    ("model.headDim", "128", "model.headDim: Input should be a valid integer"),
    ("rollout.paused", "true", "rollout.paused: Input should be a valid boolean"),
    ("model.numLayers", 32.0, "model.numLayers: Input should be a valid integer"),
    ("workload.maxContextTokens", 2**64, "less than or equal to 16777216"),
    ("gates.accuracy.minRecovery", 0.95, "gates.accuracy.minRecovery: Input should be a valid string"),
    ("model.slidingWindow", {"windowTokens": 128, "layers": [0, "1"]}, "model.slidingWindow.layers.1: Input should be"),
]


@pytest.mark.parametrize(("path", "value", "message"), STRICT_TYPES, ids=[f"{p}={v!r}" for p, v, _ in STRICT_TYPES])
def test_types_are_as_strict_as_the_api_server(path: str, value: Any, message: str) -> None:
    from kvpolicy.planning.cli import format_validation_error

    with pytest.raises(ValidationError) as caught:
        KVPolicySpec.model_validate(_mutated(path, value))
    assert message in format_validation_error(caught.value)


def test_integer_fields_are_int64_in_the_crd() -> None:
    integers = [(p, n) for p, n in _walk(_schema()) if n.get("type") == "integer"]
    assert integers and all(n.get("format") == "int64" for _, n in integers)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("model.headDim", 8, "model.headDim"),
        ("rollout.canaryReplicas", 0, "rollout.canaryReplicas"),
        ("kvCache.dtype", "FP16", "kvCache.dtype"),
        ("gates.latency.itlMaxRatio", "fast", "gates.latency.itlMaxRatio"),
        ("targetRef.kind", "StatefulSet", "targetRef.kind"),
        ("rollout.bakeSecs", 60, "rollout.bakeSecs"),
    ],
)
def test_field_errors_name_the_field(path: str, value: Any, field: str) -> None:
    from kvpolicy.planning.cli import format_validation_error

    with pytest.raises(ValidationError) as caught:
        KVPolicySpec.model_validate(_mutated(path, value))
    assert f"spec.{field}:" in format_validation_error(caught.value)
    # The schema rejects the same input (unknown fields are pruned by a structural schema, not rejected).
    if not path.endswith("bakeSecs"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(_mutated(path, value), _schema()["properties"]["spec"])
