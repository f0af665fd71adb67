"""Every number in the spec has a maximum a real deployment stays inside; absurd values are refused at admission
(pydantic and the emulated API server alike) and the operator's time arithmetic holds at every admitted maximum."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvpolicy.api import crd
from kvpolicy.api import v1alpha1 as api
from kvpolicy.rollout.rules import phase_deadline
from kvpolicy_dev.devcluster.store import ApiError, Store
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-h100-128k.yaml").read_text())

# The values a newcomer's review found admitted, and each field's path.
ABSURD = [
    (("rollout", "bakeSeconds"), 10**15),
    (("rollout", "progressDeadlineSeconds"), 10**15),
    (("rollout", "canaryReplicas"), 1_000_000),
    (("workload", "maxContextTokens"), 4_600_000_000_000_000_000),
    (("model", "maxModelLen"), 4_600_000_000_000_000_000),
    (("gates", "latency", "ttftMaxRatio"), "1000000000"),
    (("gates", "latency", "itlMaxRatio"), "1000000000"),
    (("gates", "latency", "inconclusiveDeadlineSeconds"), 10**15),
    (("gates", "latency", "intervalSeconds"), 10**15),
    (("gates", "accuracy", "timeoutSeconds"), 10**15),
    (("gates", "latency", "quantiles"), ["0." + "9" * 100]),
]


def _with(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    node = spec
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return spec


@pytest.fixture(scope="module")
def store() -> Store:
    store = Store()
    store.create(store.find_type("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None, crd.crd_object())
    store.create(store.find_type("", "v1", "namespaces"), None, {"metadata": {"name": "default"}})
    return store


@pytest.mark.parametrize(("path", "value"), ABSURD, ids=[".".join(path) for path, _ in ABSURD])
def test_absurd_numbers_are_refused_by_pydantic_naming_the_field(path: tuple[str, ...], value: Any) -> None:
    with pytest.raises(ValidationError) as refused:
        api.KVPolicySpec.model_validate(_with(BASE["spec"], path, value))
    assert path[-1] in str(refused.value) or "ratio" in str(refused.value).lower()


@pytest.mark.parametrize(("path", "value"), ABSURD, ids=[".".join(path) for path in (p for p, _ in ABSURD)])
def test_absurd_numbers_are_refused_by_the_api_server(store: Store, path: tuple[str, ...], value: Any) -> None:
    document = {**BASE, "metadata": {"name": "absurd"}, "spec": _with(BASE["spec"], path, value)}
    with pytest.raises(ApiError) as refused:
        store.create(store.find_type("kvpolicy.dev", "v1alpha1", "kvpolicies"), "default", document)
    assert refused.value.code == 422
    assert f"spec.{path[0]}" in refused.value.message


def test_every_spec_number_has_a_maximum() -> None:
    def unbounded(node: dict[str, Any], path: str) -> list[str]:
        found = [path] if node.get("type") == "integer" and "maximum" not in node else []
        if node.get("type") == "string" and node.get("pattern") == api.DECIMAL_PATTERN and "maxLength" not in node:
            found.append(path)
        for name, sub in (node.get("properties") or {}).items():
            found += unbounded(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            found += unbounded(node["items"], f"{path}[]")
        return found

    assert unbounded(crd.openapi_schema(api.KVPolicySpec), "spec") == []


def _at_maxima() -> api.KVPolicySpec:
    spec = BASE["spec"]
    for path, value in [
        (("rollout", "bakeSeconds"), api.MAX_DURATION_SECONDS),
        (("rollout", "progressDeadlineSeconds"), api.MAX_DURATION_SECONDS),
        (("gates", "latency", "inconclusiveDeadlineSeconds"), api.MAX_DURATION_SECONDS),
        (("gates", "accuracy", "timeoutSeconds"), api.MAX_DURATION_SECONDS),
    ]:
        spec = _with(spec, path, value)
    return api.KVPolicySpec.model_validate(spec)


@pytest.mark.parametrize("phase", list(api.Phase), ids=lambda phase: phase.value)
def test_phase_deadlines_are_finite_at_every_admitted_maximum(phase: api.Phase) -> None:
    entered = datetime(2026, 12, 2, tzinfo=UTC)
    policy = api.KVPolicy(spec=_at_maxima())
    policy.status.phase = phase
    policy.status.phase_entered_at = entered.isoformat().replace("+00:00", "Z")
    deadline = phase_deadline(policy)
    assert deadline is None or entered < deadline <= entered.replace(year=2027)
