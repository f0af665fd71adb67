"""The emulated API server treats a CRD as kube-apiserver does: defaults checked at CRD create, objects defaulted
recursively before validation, then the schema and the CEL rules. The shipped CRD and every KVPolicy we publish
(examples, README and docs snippets, the chart) must be admitted; what the rules forbid must still be refused."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvpolicy.api import crd
from kvpolicy.api.v1alpha1 import KVPolicySpec
from kvpolicy_dev.devcluster.store import ApiError, Store

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SPEC_FIELDS = set(crd.openapi_schema(KVPolicySpec)["properties"])
CRD_TYPE = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")


def _store_with(crd_body: dict[str, Any]) -> Store:
    store = Store()
    store.create(store.find_type(*CRD_TYPE), None, crd_body)
    store.create(store.find_type("", "v1", "namespaces"), None, {"metadata": {"name": "default"}})
    return store


@pytest.fixture(scope="module")
def store() -> Store:
    return _store_with(crd.crd_object())


def _create(store: Store, document: dict[str, Any]) -> dict[str, Any]:
    return store.create(store.find_type("kvpolicy.dev", "v1alpha1", "kvpolicies"), "default", document)


def _example(name: str = "llama-3.1-8b-h100-128k.yaml") -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / name).read_text(encoding="utf-8"))
    return document


def _renamed(document: dict[str, Any], suffix: str) -> dict[str, Any]:
    document = copy.deepcopy(document)
    document["metadata"] = {"name": re.sub(r"[^a-z0-9-]", "-", f"{document['metadata']['name']}-{suffix}")[:60]}
    return document


def _merged(base: Any, overlay: Any) -> Any:
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {**base, **{key: _merged(base.get(key), value) for key, value in overlay.items()}}
    return overlay


def _spec_snippets() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every YAML block in the README and docs that is a fragment of a KVPolicy spec."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL)
        for index, block in enumerate(blocks):
            document = yaml.safe_load(block)
            spec = document.get("spec") if isinstance(document, dict) else None
            if isinstance(spec, dict) and spec and set(spec) <= SPEC_FIELDS:
                yield f"{path.name}#{index}", spec


SNIPPETS = list(_spec_snippets())


def test_the_shipped_crd_file_is_admitted() -> None:
    on_disk = yaml.safe_load((ROOT / "crds" / "kvpolicy.yaml").read_text(encoding="utf-8"))
    chart_copy = yaml.safe_load((ROOT / "charts" / "kvpolicy-operator" / "crds" / "kvpolicy.yaml").read_text())
    for document in (on_disk, chart_copy):
        _store_with(document)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_every_example_is_admitted(store: Store, example: Path) -> None:
    _create(store, _renamed(_example(example.name), "example"))


def test_the_docs_hold_spec_snippets() -> None:
    assert len(SNIPPETS) >= 4, SNIPPETS  # notifications, authentication, custom checks, Advisory mode


@pytest.mark.parametrize(("where", "snippet"), SNIPPETS, ids=[where for where, _ in SNIPPETS])
def test_every_readme_and_docs_snippet_is_admitted(store: Store, where: str, snippet: dict[str, Any]) -> None:
    document = _example()
    document["spec"] = _merged(document["spec"], snippet)
    _create(store, _renamed(document, where.lower().replace(".md#", "-")))


def test_an_absent_optional_object_stays_absent_and_absent_defaults_are_filled(store: Store) -> None:
    document = _renamed(_example(), "defaults")
    document["spec"].pop("gates", None)
    stored = _create(store, document)["spec"]
    assert "prometheusAuth" not in stored["gates"]["latency"]
    assert "vllmAuth" not in stored and "analysis" not in stored
    expected = KVPolicySpec.model_validate(document["spec"]).to_k8s()
    assert stored["gates"] == expected["gates"]
    assert stored["kvCache"] == expected["kvCache"]


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        (("gates", "accuracy", "minRecovery"), "2", "gates.accuracy.minRecovery must be a number in (0, 1]"),
        (("workload", "maxContextTokens"), "lots", "must be of type integer"),
        (("kvCache", "dtype"), "FP9", "supported values:"),
        (("gates", "latency", "prometheusAuth"), {"tls": {"insecureSkipVerify": True}}, "needs an https://"),
    ],
)
def test_the_rules_still_refuse_what_they_should(store: Store, path: tuple[str, ...], value: Any, said: str) -> None:
    document = _renamed(_example(), "bad")
    node = document["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(ApiError) as refused:
        _create(store, document)
    assert refused.value.code == 422
    assert said in refused.value.message
    assert f"spec.{path[0]}" in refused.value.message


def test_a_required_field_left_out_is_refused(store: Store) -> None:
    document = _renamed(_example(), "required")
    del document["spec"]["model"]
    with pytest.raises(ApiError, match=r"spec\.model: Required value"):
        _create(store, document)


def _tiny_crd(default: Any, rules: list[dict[str, str]], inner: dict[str, Any]) -> dict[str, Any]:
    settings = {"type": "object", "properties": inner, "x-kubernetes-validations": rules}
    if default is not None:
        settings["default"] = default
    spec_schema = {"type": "object", "properties": {"settings": settings}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.dev"},
        "spec": {
            "group": "example.dev",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": spec_schema}}},
                }
            ],
        },
    }


def test_a_crd_whose_default_breaks_its_own_rule_is_refused() -> None:
    """The shape of the bug kvpolicy shipped: `default: {}` on an object whose rule needs a field."""
    rule = [{"rule": "has(self.min) || has(self.max)", "message": "a range needs min, max or both"}]
    body = _tiny_crd({}, rule, {"min": {"type": "string"}, "max": {"type": "string"}})
    with pytest.raises(ApiError) as refused:
        _store_with(body)
    assert refused.value.code == 422
    assert (
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].properties[settings].default: "
        'Invalid value: "object": a range needs min, max or both'
    ) in refused.value.message


def test_a_default_valid_only_once_defaulted_itself_is_refused() -> None:
    """Some kube-apiserver releases validate a default as written: do not depend on defaulting it first."""
    rule = [{"rule": "self.mode == 'On'", "message": "mode must be On"}]
    body = _tiny_crd({}, rule, {"mode": {"type": "string", "default": "On"}})
    with pytest.raises(ApiError, match="no such key: mode evaluating rule"):
        _store_with(body)
    _store_with(_tiny_crd({"mode": "On"}, rule, {"mode": {"type": "string", "default": "On"}}))


def test_defaults_apply_recursively_before_the_rules_run() -> None:
    """An absent object with a default is filled in, its own defaults too, and then its rules see the result."""
    rule = [{"rule": "self.mode == 'On'", "message": "mode must be On"}]
    store = _store_with(_tiny_crd({"mode": "On"}, rule, {"mode": {"type": "string", "default": "On"}}))
    widgets = store.find_type("example.dev", "v1", "widgets")
    stored = store.create(widgets, "default", {"metadata": {"name": "a"}, "spec": {}})
    assert stored["spec"] == {"settings": {"mode": "On"}}
    with pytest.raises(ApiError, match="mode must be On"):
        store.create(widgets, "default", {"metadata": {"name": "b"}, "spec": {"settings": {"mode": "Off"}}})


def test_status_writes_are_validated_against_the_status_schema(store: Store) -> None:
    created = _create(store, _renamed(_example(), "status"))
    kvpolicies = store.find_type("kvpolicy.dev", "v1alpha1", "kvpolicies")
    name = created["metadata"]["name"]
    with pytest.raises(ApiError, match=r"status\.observedGeneration"):
        store.patch(kvpolicies, "default", name, "application/merge-patch+json",
                    {"status": {"observedGeneration": "first"}}, subresource="status")  # fmt: skip
    store.patch(kvpolicies, "default", name, "application/merge-patch+json",
                {"status": {"observedGeneration": 1}}, subresource="status")  # fmt: skip


def test_updates_ratchet_values_left_as_they_were() -> None:
    """An object stored before a stricter CRD stays writable (labels, finalizers, status) while its invalid value
    is left alone; changing that value to another invalid one is refused."""
    rule = [{"rule": "self.mode == 'On'", "message": "mode must be On"}]
    inner = {"mode": {"type": "string"}}
    store = _store_with(_tiny_crd(None, [], inner))
    widgets = store.find_type("example.dev", "v1", "widgets")
    store.create(widgets, "default", {"metadata": {"name": "a"}, "spec": {"settings": {"mode": "Off"}}})
    crds = store.find_type(*CRD_TYPE)
    store.patch(crds, None, "widgets.example.dev", "application/merge-patch+json", _tiny_crd(None, rule, inner))
    widgets = store.find_type("example.dev", "v1", "widgets")
    labelled = store.patch(
        widgets, "default", "a", "application/merge-patch+json", {"metadata": {"labels": {"x": "y"}}}
    )
    assert labelled["metadata"]["labels"] == {"x": "y"}
    with pytest.raises(ApiError, match="mode must be On"):
        store.patch(widgets, "default", "a", "application/merge-patch+json", {"spec": {"settings": {"mode": "Auto"}}})
