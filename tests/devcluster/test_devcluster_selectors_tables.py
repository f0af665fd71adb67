import datetime

import pytest
from kvpolicy_dev.devcluster.selectors import (
    SelectorError,
    match_labels,
    parse_field_selector,
    parse_label_selector,
)
from kvpolicy_dev.devcluster.tables import (
    AGE_COLUMN,
    JSONPathError,
    PrinterColumn,
    human_age,
    jsonpath_values,
    render_table,
)


def labelled(**labels: str) -> dict:
    return {"metadata": {"name": "x", "labels": labels}}


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("app=web", {"app": "web"}, True),
        ("app==web", {"app": "db"}, False),
        ("app!=web", {}, True),
        ("app in (web, db)", {"app": "db"}, True),
        ("app in (web,db),tier notin (gpu)", {"app": "web", "tier": "gpu"}, False),
        ("app notin (web)", {}, True),
        ("canary", {"canary": ""}, True),
        ("!canary", {"canary": "true"}, False),
        ("!canary,app=web", {"app": "web"}, True),
        ("kvpolicy.dev/role=canary", {"kvpolicy.dev/role": "canary"}, True),
    ],
)
def test_label_selector(selector: str, labels: dict, expected: bool) -> None:
    assert parse_label_selector(selector)(labelled(**labels)) is expected


@pytest.mark.parametrize("selector", ["app in (a", "!app in (a)", "a=b=c", "=x"])
def test_label_selector_rejects_malformed(selector: str) -> None:
    with pytest.raises(SelectorError):
        parse_label_selector(selector)


def test_field_selector_on_name_and_nested_fields() -> None:
    pod = {"metadata": {"name": "p1", "namespace": "ns"}, "spec": {"nodeName": "h100-0"}}
    assert parse_field_selector("metadata.name=p1,spec.nodeName=h100-0")(pod)
    assert not parse_field_selector("metadata.name!=p1")(pod)
    assert parse_field_selector("spec.missing=")(pod)
    with pytest.raises(SelectorError, match="field=value"):
        parse_field_selector("metadata.name in (a)")


def test_structured_label_selectors() -> None:
    labels = {"app": "vllm", "track": "canary"}
    assert match_labels({"app": "vllm"}, labels)  # a Service's plain map
    assert match_labels({"matchLabels": {"app": "vllm"}, "matchExpressions": [
        {"key": "track", "operator": "In", "values": ["canary", "stable"]},
        {"key": "gone", "operator": "DoesNotExist"},
    ]}, labels)  # fmt: skip
    assert not match_labels({"matchExpressions": [{"key": "track", "operator": "NotIn", "values": ["canary"]}]}, labels)
    assert not match_labels({}, labels)  # an empty Service selector selects nothing
    with pytest.raises(SelectorError, match="Gt"):
        match_labels({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}, labels)


def test_jsonpath_subset() -> None:
    obj = {
        "metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
        "status": {"conditions": [{"type": "Gate", "status": "False"}, {"type": "Ready", "status": "True"}]},
    }
    assert jsonpath_values(obj, r".metadata.labels.nvidia\.com/gpu\.product") == ["NVIDIA-H200"]
    assert jsonpath_values(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath_values(obj, "{.status.conditions[*].type}") == ["Gate", "Ready"]
    assert jsonpath_values(obj, ".status.conditions[5].type") == []
    assert jsonpath_values(obj, ".spec.replicas") == []
    with pytest.raises(JSONPathError, match="unsupported JSONPath"):
        jsonpath_values(obj, ".status..type")


def test_human_age() -> None:
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert human_age("2026-01-02T03:04:00Z", now) == "5s"
    assert human_age("2026-01-02T02:00:00Z", now) == "1h"
    assert human_age("2025-12-30T00:00:00Z", now) == "3d"


def test_render_table_uses_printer_columns() -> None:
    now = datetime.datetime(2026, 1, 1, 0, 1, 0, tzinfo=datetime.UTC)
    columns = (PrinterColumn("Phase", "string", ".status.phase"), PrinterColumn("Size", "integer", ".spec.size"),
               AGE_COLUMN)  # fmt: skip
    objects = [{"metadata": {"name": "a", "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"size": 3},
                "status": {"phase": "Canary"}}]  # fmt: skip
    table = render_table(objects, columns, "7", now)
    assert [column["name"] for column in table["columnDefinitions"]] == ["Name", "Phase", "Size", "Age"]
    assert table["rows"][0]["cells"] == ["a", "Canary", 3, "1m"]
    assert table["rows"][0]["object"]["metadata"]["name"] == "a"
    assert table["metadata"]["resourceVersion"] == "7"
