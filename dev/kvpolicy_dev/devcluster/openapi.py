"""What kube-apiserver does with a CRD's structural schema: defaulting, validation and the CEL rules.

- At CRD create and update every `default` is checked against the schema and the rules of the node it sits on, both
  as written and after its own defaults are applied (kube-apiserver releases differ in whether they default a default
  first; a CRD that passes both is admitted by either).
- A custom object is defaulted recursively before it is validated, like a request body on decode: an absent field
  with a `default` gets a copy of it, and the defaulted value is defaulted in turn.
- Validation: the OpenAPI v3 keywords through `jsonschema` (draft 4, the dialect structural schemas use), then each
  `x-kubernetes-validations` rule through cel-python on the node's value, where the schema itself held.

Errors carry kube-apiserver's field paths and wording (`spec.gates.accuracy: Invalid value: "object": <message>`).
Not emulated: pruning of unknown fields, transition rules (`oldSelf`), ratcheting, and CEL cost limits.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

import celpy
import jsonschema
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError

from kvpolicy_dev.devcluster.validation import FieldError

Schema = Mapping[str, Any]


def apply_defaults(value: Any, schema: Schema) -> Any:
    """`value` with the schema's defaults filled in, recursively (the input is not changed)."""
    if isinstance(value, dict):
        result = dict(value)
        properties: Mapping[str, Schema] = schema.get("properties") or {}
        for name, sub in properties.items():
            if name not in result and "default" in sub:
                result[name] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for name, item in result.items():
            if name in properties:
                result[name] = apply_defaults(item, properties[name])
            elif isinstance(extra, Mapping):
                result[name] = apply_defaults(item, extra)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def _kind_of(value: Any) -> str:
    """How kube-apiserver names a value's type in `Invalid value: "<type>"`."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "string"


def _shown(value: Any) -> str:
    return _kind_of(value) if isinstance(value, dict | list) else str(json.dumps(value)).strip('"')


def _field_path(prefix: str, parts: Iterator[Any] | list[Any]) -> str:
    path = prefix
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else (f"{path}.{part}" if path else str(part))
    return path


_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_ABSENT = object()


def value_at(obj: Any, field: str) -> Any:
    """The value a field path (`spec.checks[0].range`) names in an object; a sentinel where there is none."""
    for name, index in _PATH_PART.findall(field):
        if name and isinstance(obj, Mapping) and name in obj:
            obj = obj[name]
        elif index and isinstance(obj, list) and int(index) < len(obj):
            obj = obj[int(index)]
        else:
            return _ABSENT
    return obj


@lru_cache(maxsize=4096)
def _program(rule: str) -> celpy.Runner:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


_MISSING_MEMBER = re.compile(r"no such member in mapping: '([^']*)'")


def _evaluation_error(error: object, rule: str) -> str:
    """A rule that could not be evaluated, worded like kube-apiserver (`no such key: x evaluating rule: ...`)."""
    missing = _MISSING_MEMBER.search(str(error))
    cause = f"no such key: {missing.group(1)}" if missing else "the rule could not be evaluated"
    return f"{cause} evaluating rule: {rule}"


def _rule_failure(rule: Mapping[str, Any], value: Any) -> str | None:
    """None when the rule holds; otherwise the message kube-apiserver reports."""
    return _cached_rule_failure(json.dumps(rule, sort_keys=True), json.dumps(value, sort_keys=True))


# cel-python walks the rule's parse tree in Python: 10-30 ms per rule on a 2-core box, ~15 rules per KVPolicy write.
# A rule's outcome depends on the rule and the value alone, and most subtrees of a policy (and of its status between
# two writes) repeat, so the emulator keeps recent outcomes: thousands of policies can be written in minutes.
@lru_cache(maxsize=65536)
def _cached_rule_failure(rule_json: str, value_json: str) -> str | None:
    return _evaluate_rule(json.loads(rule_json), json.loads(value_json))


def _evaluate_rule(rule: Mapping[str, Any], value: Any) -> str | None:
    activation = {"self": json_to_cel(value)}
    try:
        outcome = _program(str(rule["rule"])).evaluate(activation)
    except (CELEvalError, CELParseError, TypeError, KeyError, ValueError) as error:
        return _evaluation_error(error, str(rule["rule"]))
    if isinstance(outcome, CELEvalError):
        return _evaluation_error(outcome, str(rule["rule"]))
    if bool(outcome):
        return None
    if "messageExpression" in rule:
        try:
            return str(_program(str(rule["messageExpression"])).evaluate(activation))
        except (CELEvalError, TypeError, KeyError, ValueError):
            pass  # kube-apiserver falls back to the static message
    return str(rule.get("message") or f"failed rule: {rule['rule']}")


def _rule_errors(value: Any, schema: Schema, path: str) -> list[FieldError]:
    errors = [
        FieldError(path, _kind_of(value), message)
        for rule in schema.get("x-kubernetes-validations") or ()
        if (message := _rule_failure(rule, value)) is not None
    ]
    if isinstance(value, dict):
        properties: Mapping[str, Schema] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            sub = properties.get(name) or (extra if isinstance(extra, Mapping) else None)
            if sub is not None:
                errors += _rule_errors(item, sub, _field_path(path, [name]))
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            errors += _rule_errors(item, schema["items"], f"{path}[{index}]")
    return errors


# jsonschema's keyword -> kube-apiserver's wording of the failure (`<field> in body <wording>`).
_WORDING = {
    "maximum": "should be less than or equal to {}",
    "minimum": "should be greater than or equal to {}",
    "maxLength": "may not be longer than {}",
    "minLength": "should be at least {} chars long",
    "pattern": "should match '{}'",
    "maxItems": "must have at most {} items",
    "minItems": "should have at least {} items",
    "maxProperties": "must have at most {} properties",
    "minProperties": "should have at least {} properties",
}


def _schema_error(error: jsonschema.ValidationError, prefix: str) -> FieldError:
    field = _field_path(prefix, list(error.absolute_path))
    if error.validator == "required":
        missing = str(error.message).split("'")[1]
        return FieldError(_field_path(field, [missing]), "", "", reason="FieldValueRequired")
    if error.validator == "enum":
        options = error.validator_value if isinstance(error.validator_value, list) else []
        supported = ", ".join(json.dumps(option) for option in options)
        return FieldError(field, _shown(error.instance), f"supported values: {supported}", "FieldValueNotSupported")
    if error.validator == "type":
        detail = f'{field} in body must be of type {error.validator_value}: "{_kind_of(error.instance)}"'
        return FieldError(field, _kind_of(error.instance), detail)
    wording = _WORDING.get(str(error.validator), "is invalid ({})").format(error.validator_value)
    return FieldError(field, _shown(error.instance), f"{field} in body {wording}")


def schema_errors(value: Any, schema: Schema, path: str) -> list[FieldError]:
    """The errors kube-apiserver reports for `value` (already defaulted) against a structural schema."""
    validator = jsonschema.Draft4Validator(schema)
    found = sorted(validator.iter_errors(value), key=lambda error: list(map(str, error.absolute_path)))
    if found:
        return [_schema_error(error, path) for error in found]
    return _rule_errors(value, schema, path)


def _defaults(schema: Schema, path: str) -> Iterator[tuple[str, Any, Schema]]:
    """(CRD field path of the default, the default, the schema it must satisfy) for every default in a schema."""
    if "default" in schema:
        yield f"{path}.default", schema["default"], schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _defaults(sub, f"{path}.properties[{name}]")
    if isinstance(schema.get("items"), Mapping):
        yield from _defaults(schema["items"], f"{path}.items")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from _defaults(schema["additionalProperties"], f"{path}.additionalProperties")


def default_errors(schema: Schema, path: str) -> list[FieldError]:
    """Defaults that break their own schema or rules, as written or once defaulted themselves."""
    errors: list[FieldError] = []
    for where, default, node in _defaults(schema, path):
        problems = schema_errors(default, node, "") or schema_errors(apply_defaults(default, node), node, "")
        errors += [FieldError(where, problem.value, problem.detail) for problem in problems[:1]]
    return errors
