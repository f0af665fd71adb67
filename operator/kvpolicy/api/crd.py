"""Generate the KVPolicy CustomResourceDefinition from the pydantic models.

`kvpolicy crd` prints it; `crds/kvpolicy.yaml` is this output, and a test fails when the file is stale.
The pydantic JSON schema is turned into a structural OpenAPI v3 schema: `$ref`s inlined, `anyOf [T, null]` collapsed
to `T`, titles dropped, and each model's `Rule`s attached as `x-kubernetes-validations`. Integers are `format: int64`,
the range the API server stores.

Defaults: kube-apiserver validates every default against its schema and rules when the CRD is created (some releases
without defaulting the default first), and applies defaults recursively before it validates an object. So a nested
object gets a default only where the model builds one itself (`default_factory`), and that default is the built
object in full, which its own rules already passed; an optional object (`X | None = None`) gets none, so its rules
only ever see what a user wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue

from kvpolicy.api import v1alpha1 as api

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    # What the target serves after the latest decision: a rolled-back FP8 plan reads BF16 here, not FP8.
    {
        "name": "KV",
        "type": "string",
        "jsonPath": ".status.decision.kvCacheDtype",
        "description": "KV cache dtype the target serves after the latest decision",
    },
    {"name": "GPU", "type": "string", "jsonPath": ".status.gpu.product"},
    {"name": "Decision", "type": "string", "jsonPath": ".status.decision.result"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.decision.reason"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Planned",
        "type": "string",
        "jsonPath": ".status.plan.kvCacheDtype",
        "description": "KV cache dtype the current plan asks for",
        "priority": 1,
    },
]

_DROP_KEYS = {"title"}


def _validation(rule: api.Rule) -> dict[str, str]:
    entry = {"rule": rule.cel, "message": rule.message}
    if rule.message_expression is not None:
        entry["messageExpression"] = rule.message_expression
    return entry


def _model_rules() -> dict[str, list[dict[str, str]]]:
    """Rules per JSON-schema definition name (pydantic names definitions after the class)."""
    found: dict[str, list[dict[str, str]]] = {}
    for value in vars(api).values():
        rules: tuple[api.Rule, ...] = getattr(value, "rules", ())
        if isinstance(value, type) and issubclass(value, BaseModel) and rules:
            found[value.__name__] = [_validation(r) for r in rules]
    return found


def _without_nulls(value: Any) -> Any:
    """A default as the API server may store it: a null would fail the field's own type."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


class _FactoryDefaults(GenerateJsonSchema):
    """Write what a `default_factory` builds as the field's default (pydantic leaves such defaults out)."""

    def get_default_value(self, schema: Any) -> Any:  # pydantic_core's WithDefaultSchema
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            return factory()
        return super().get_default_value(schema)

    def default_schema(self, schema: Any) -> JsonSchemaValue:
        json_schema = super().default_schema(schema)
        if "default" in json_schema:
            json_schema["default"] = _without_nulls(json_schema["default"])
        return json_schema


class _Structuralizer:
    def __init__(self, definitions: dict[str, Any]) -> None:
        self.definitions = definitions
        self.rules = _model_rules()

    def convert(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.convert(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            merged = {**self.definitions[name], **{k: v for k, v in node.items() if k != "$ref"}}
            converted = self.convert(merged)
            if name in self.rules:
                converted["x-kubernetes-validations"] = self.rules[name]
            return converted
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o != {"type": "null"}]
            if len(options) != 1:
                raise ValueError(f"cannot express anyOf {node['anyOf']} structurally")
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if rest.get("default", "absent") is None:
                del rest["default"]
            return self.convert({**options[0], **rest})
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROP_KEYS:
                continue
            if key == "properties":
                out[key] = {prop: self.convert(sub) for prop, sub in value.items()}
            elif key == "additionalProperties" and value is False:
                continue  # extra="forbid": structural schemas prune unknown fields instead
            else:
                out[key] = self.convert(value)
        if out.get("type") == "integer":
            out.setdefault("format", "int64")
        return out


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _without_defaults(value) for key, value in node.items() if key != "default"}
    if isinstance(node, list):
        return [_without_defaults(item) for item in node]
    return node


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_FactoryDefaults)
    definitions = schema.pop("$defs", {})
    structuralizer = _Structuralizer(definitions)
    converted: dict[str, Any] = structuralizer.convert(schema)
    if model.__name__ in structuralizer.rules:
        converted["x-kubernetes-validations"] = structuralizer.rules[model.__name__]
    return converted


def crd_object() -> dict[str, Any]:
    spec_schema = openapi_schema(api.KVPolicySpec)
    # The operator writes status in full: defaults there would only add empty lists to every status write.
    status_schema = _without_defaults(openapi_schema(api.KVPolicyStatus))
    status_schema.pop("required", None)
    # kopf may keep its own progress under status.kopf; nothing else is free-form.
    conditions = status_schema["properties"]["conditions"]
    conditions.update({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    status_schema["properties"]["kopf"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    spec_schema.pop("default", None)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "KVPolicy rolls a vLLM Deployment out to an FP8 KV cache where it is safe.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `kvpolicy crd` from operator/kvpolicy/api/v1alpha1.py. Do not edit.\n"
    return header + yaml.safe_dump(crd_object(), sort_keys=False, width=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvpolicy crd", description="Print the KVPolicy CRD (YAML).")
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    parser.add_argument("--reference", action="store_true", help="print the spec reference (Markdown) instead")
    args = parser.parse_args(argv)
    text = reference_markdown() + "\n" if args.reference else render()
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as error:
            print(f"kvpolicy crd: cannot write {args.output}: {error.strerror}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


def _type_of(node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{value}`" for value in node["enum"])
    if node.get("type") == "array":
        return f"list of {_type_of(node.get('items', {}))}"
    if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
        return "map of string"
    if node.get("pattern") == api.DECIMAL_PATTERN:
        return "decimal string"
    return str(node.get("type", "object"))


def reference_markdown() -> str:
    """The KVPolicy spec as a Markdown table (the README embeds it; a test keeps it in step with the models)."""
    spec_schema = openapi_schema(api.KVPolicySpec)
    rows = ["| field | type | default | description |", "|---|---|---|---|"]

    def visit(node: dict[str, Any], prefix: str, required: set[str]) -> None:
        for name, sub in node.get("properties", {}).items():
            path = f"{prefix}{name}"
            default = sub.get("default")
            # An object's default is its fields' defaults, shown on their own rows.
            hidden = default is None or isinstance(default, dict)
            shown = "required" if name in required else ("" if hidden else f"`{json.dumps(default)}`")
            description = str(sub.get("description", "")).replace("|", "\\|")
            rows.append(f"| `{path}` | {_type_of(sub)} | {shown} | {description} |")
            if sub.get("type") == "object" and "properties" in sub:
                visit(sub, f"{path}.", set(sub.get("required", [])))

    visit(spec_schema, "spec.", set(spec_schema.get("required", [])))
    rules = [f"- {rule['message']} (`{rule['rule']}`)" for rules in _model_rules().values() for rule in rules]
    return "\n".join([*rows, "", "Validation rules (CEL in the CRD, the same checks in `kvpolicy plan`):", "", *rules])
