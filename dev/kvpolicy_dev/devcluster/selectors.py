"""Kubernetes label and field selectors: parsing and matching (pure functions)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Selector = Callable[[Mapping[str, Any]], bool]

# One requirement of a label selector; `in`/`notin` sets may contain commas, so they are matched first.
_SET_REQUIREMENT = re.compile(r"\s*(!?)\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQUALITY_REQUIREMENT = re.compile(r"\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")
_EXISTENCE_REQUIREMENT = re.compile(r"\s*(!?)\s*([\w./-]+)\s*$")


class SelectorError(ValueError):
    """A selector the API server cannot parse (answered with 400 BadRequest)."""


def _split_requirements(selector: str) -> list[str]:
    """Split on commas that are not inside a parenthesised value set."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part for part in parts if part.strip()]


def _label_requirement(text: str) -> Callable[[Mapping[str, str]], bool]:
    if match := _SET_REQUIREMENT.match(text):
        negated, key, operator, values_text = match.groups()
        if negated:
            raise SelectorError(f"invalid label selector requirement {text!r}: '!' cannot prefix a set operator")
        values = {value.strip() for value in values_text.split(",") if value.strip()}
        if operator == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQUALITY_REQUIREMENT.match(text):
        key, operator, value = match.groups()
        if operator == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := _EXISTENCE_REQUIREMENT.match(text):
        negated, key = match.groups()
        if negated:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise SelectorError(f"invalid label selector requirement {text!r}")


def parse_label_selector(selector: str) -> Selector:
    """Parse `a=b,c!=d,e in (x,y),f notin (z),g,!h` into a predicate over an object."""
    requirements = [_label_requirement(part) for part in _split_requirements(selector)]

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(requirement(labels) for requirement in requirements)

    return matches


def field_value(obj: Mapping[str, Any], dotted_path: str) -> str:
    """The value of a field as a field selector sees it: a string, '' when absent."""
    value: Any = obj
    for key in dotted_path.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _field_requirement(text: str) -> Selector:
    match = _EQUALITY_REQUIREMENT.match(text)
    if match is None:
        raise SelectorError(f"invalid field selector requirement {text!r}: use field=value or field!=value")
    path, operator, value = match.groups()
    if operator == "!=":
        return lambda obj: field_value(obj, path) != value
    return lambda obj: field_value(obj, path) == value


def parse_field_selector(selector: str) -> Selector:
    """Parse `metadata.name=x,spec.nodeName!=y` (equality operators only, as Kubernetes allows)."""
    requirements = [_field_requirement(part) for part in _split_requirements(selector)]
    return lambda obj: all(requirement(obj) for requirement in requirements)


def match_labels(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Match a structured LabelSelector (`matchLabels` + `matchExpressions`) or a plain map (Services)."""
    if not selector:
        return False
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        return all(labels.get(key) == value for key, value in selector.items())
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    return all(_match_expression(expression, labels) for expression in selector.get("matchExpressions") or [])


def _match_expression(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], set(expression.get("values") or [])
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise SelectorError(f"unknown matchExpressions operator {operator!r}")
