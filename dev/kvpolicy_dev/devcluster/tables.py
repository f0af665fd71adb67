"""Server-side printing: the `Table` kubectl asks for, built from printer columns and JSONPath (pure functions)."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# `.a.b`, `.a\.b` (one key holding a dot), `.a[0]`, `.a[*]`, `.a[?(@.type=="Ready")]`: what printer columns use.
_STEP = re.compile(r"""\.((?:[\w/-]|\\\.)+)|\[(\d+|\*)\]|\[\?\(@\.([\w.-]+)\s*==\s*["']([^"']*)["']\)\]""")


class JSONPathError(ValueError):
    """A printer-column JSONPath outside the supported subset."""


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0
    format: str = ""

    @classmethod
    def from_crd(cls, column: Mapping[str, Any]) -> PrinterColumn:
        return cls(
            name=column["name"],
            type=column.get("type", "string"),
            json_path=column["jsonPath"],
            description=column.get("description", ""),
            priority=int(column.get("priority", 0)),
            format=column.get("format", ""),
        )


AGE_COLUMN = PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation")


def jsonpath_values(obj: Any, path: str) -> list[Any]:
    """All values a printer-column JSONPath selects in `obj` (empty when the path leads nowhere)."""
    expression = path.strip()
    if expression.startswith("{") and expression.endswith("}"):
        expression = expression[1:-1]
    position = 0
    values = [obj]
    while position < len(expression):
        match = _STEP.match(expression, position)
        if match is None:
            raise JSONPathError(f"unsupported JSONPath {path!r} at {expression[position:]!r}")
        key, index, filter_key, filter_value = match.groups()
        values = [result for value in values for result in _step(value, key, index, filter_key, filter_value)]
        position = match.end()
    return values


def _step(
    value: Any, key: str | None, index: str | None, filter_key: str | None, filter_value: str | None
) -> list[Any]:
    if key is not None:
        key = key.replace("\\.", ".")  # `nvidia\.com/gpu\.product` names one key with dots
        return [value[key]] if isinstance(value, Mapping) and key in value else []
    if not isinstance(value, Sequence) or isinstance(value, str):
        return []
    if index == "*":
        return list(value)
    if index is not None:
        return [value[int(index)]] if int(index) < len(value) else []
    assert filter_key is not None
    return [item for item in value if _matches_filter(item, filter_key, filter_value)]


def _matches_filter(item: Any, dotted_key: str, expected: str | None) -> bool:
    found = jsonpath_values(item, "." + dotted_key)
    return bool(found) and str(found[0]) == expected


def human_age(timestamp: str, now: datetime.datetime) -> str:
    """kubectl's short age: 42s, 5m, 3h, 2d."""
    created = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = max(0, int((now - created).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def cell(obj: Mapping[str, Any], column: PrinterColumn, now: datetime.datetime) -> Any:
    values = jsonpath_values(obj, column.json_path)
    if not values:
        return None
    if column.type == "date" and isinstance(values[0], str):
        return human_age(values[0], now)
    if len(values) > 1:
        return ",".join(value if isinstance(value, str) else json.dumps(value) for value in values)
    value = values[0]
    if column.type in ("integer", "number", "boolean") or isinstance(value, str):
        return value
    return json.dumps(value)


def column_definitions(columns: Sequence[PrinterColumn]) -> list[dict[str, Any]]:
    name_column = {"name": "Name", "type": "string", "format": "name", "description": "Object name", "priority": 0}
    return [name_column] + [
        {
            "name": column.name,
            "type": column.type,
            "format": column.format,
            "description": column.description,
            "priority": column.priority,
        }
        for column in columns
    ]


def render_table(
    objects: Sequence[Mapping[str, Any]],
    columns: Sequence[PrinterColumn],
    resource_version: str,
    now: datetime.datetime,
) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table of `objects`; rows carry partial object metadata as kubectl expects."""
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": column_definitions(columns),
        "rows": [
            {
                "cells": [obj["metadata"]["name"]] + [cell(obj, column, now) for column in columns],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                },
            }
            for obj in objects
        ],
    }
