"""The state layer: resource versions, generations, conflicts, status subresource, deletion, GC, event log, CRDs."""

import pytest
from kvpolicy_dev.devcluster.store import (
    JSON_PATCH,
    MERGE_PATCH,
    ApiError,
    Store,
    merge_patch,
    strategic_merge_patch,
)

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.dev"},
    "spec": {
        "group": "example.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wdg"]},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}}}],
    },
}


@pytest.fixture
def store() -> Store:
    store = Store()
    store.create(store.type_for("v1", "Namespace"), None, {"metadata": {"name": "ns"}})
    return store


def widget_type(store: Store):
    store.create(store.type_for("apiextensions.k8s.io/v1", "CustomResourceDefinition"), None, CRD)
    return store.find_type("example.dev", "v1", "widgets")


def test_create_stamps_metadata_and_drops_status_of_status_subresource(store: Store) -> None:
    widgets = widget_type(store)
    obj = store.create(widgets, "ns", {"metadata": {"name": "w"}, "spec": {"size": 1}, "status": {"phase": "x"}})
    meta = obj["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) == store.resource_version
    assert obj["apiVersion"] == "example.dev/v1" and obj["kind"] == "Widget" and "status" not in obj
    with pytest.raises(ApiError) as exc:
        store.create(widgets, "ns", {"metadata": {"name": "w"}})
    assert (exc.value.code, exc.value.reason) == (409, "AlreadyExists")


def test_create_needs_an_existing_namespace_and_a_name(store: Store) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    with pytest.raises(ApiError, match='namespaces "nope" not found') as exc:
        store.create(configmaps, "nope", {"metadata": {"name": "c"}})
    assert exc.value.code == 404
    with pytest.raises(ApiError, match=r"metadata\.name") as exc:
        store.create(configmaps, "ns", {"metadata": {}})
    assert exc.value.code == 422
    generated = store.create(configmaps, "ns", {"metadata": {"generateName": "gate-"}})
    assert generated["metadata"]["name"].startswith("gate-") and len(generated["metadata"]["name"]) == 10


def test_generation_counts_spec_changes_only(store: Store) -> None:
    widgets = widget_type(store)
    store.create(widgets, "ns", {"metadata": {"name": "w"}, "spec": {"size": 1}})
    versions = [store.get(widgets, "ns", "w")["metadata"]["resourceVersion"]]
    store.patch(widgets, "ns", "w", MERGE_PATCH, {"metadata": {"labels": {"a": "b"}}})
    store.patch(widgets, "ns", "w", MERGE_PATCH, {"status": {"phase": "Canary"}}, subresource="status")
    assert store.get(widgets, "ns", "w")["metadata"]["generation"] == 1
    store.patch(widgets, "ns", "w", MERGE_PATCH, {"spec": {"size": 2}})
    obj = store.get(widgets, "ns", "w")
    assert obj["metadata"]["generation"] == 2
    versions.append(obj["metadata"]["resourceVersion"])
    assert int(versions[1]) == int(versions[0]) + 3  # every write takes the next resourceVersion


def test_status_subresource_is_kept_apart_from_the_main_resource(store: Store) -> None:
    widgets = widget_type(store)
    store.create(widgets, "ns", {"metadata": {"name": "w"}, "spec": {"size": 1}})
    store.patch(widgets, "ns", "w", MERGE_PATCH, {"spec": {"size": 9}, "status": {"phase": "A"}}, subresource="status")
    obj = store.get(widgets, "ns", "w")
    assert obj["spec"] == {"size": 1} and obj["status"] == {"phase": "A"}
    store.replace(widgets, "ns", "w", {**obj, "spec": {"size": 2}, "status": {"phase": "ignored"}})
    obj = store.get(widgets, "ns", "w")
    assert obj["spec"] == {"size": 2} and obj["status"] == {"phase": "A"}
    configmaps = store.type_for("v1", "ConfigMap")
    store.create(configmaps, "ns", {"metadata": {"name": "c"}})
    with pytest.raises(ApiError, match="no subresource") as exc:
        store.patch(configmaps, "ns", "c", MERGE_PATCH, {"status": {}}, subresource="status")
    assert exc.value.code == 404


def test_stale_resource_version_conflicts(store: Store) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    old = store.create(configmaps, "ns", {"metadata": {"name": "c"}, "data": {"k": "1"}})
    store.patch(configmaps, "ns", "c", MERGE_PATCH, {"data": {"k": "2"}})
    for write in (
        lambda: store.replace(configmaps, "ns", "c", {**old, "data": {"k": "3"}}),
        lambda: store.patch(configmaps, "ns", "c", MERGE_PATCH, {"metadata": {"resourceVersion": "1"}}),
    ):
        with pytest.raises(ApiError, match="the object has been modified") as exc:
            write()
        assert (exc.value.code, exc.value.reason) == (409, "Conflict")
    assert store.get(configmaps, "ns", "c")["data"] == {"k": "2"}


def test_json_patch_failed_test_is_422_and_applies_nothing(store: Store) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    obj = store.create(configmaps, "ns", {"metadata": {"name": "c"}, "data": {"k": "1"}})
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"}, {"op": "remove", "path": "/data"}]
    with pytest.raises(ApiError) as exc:
        store.patch(configmaps, "ns", "c", JSON_PATCH, stale)
    assert (exc.value.code, exc.value.reason) == (422, "Invalid")
    fresh = [{"op": "test", "path": "/metadata/resourceVersion", "value": obj["metadata"]["resourceVersion"]},
             {"op": "add", "path": "/data/x", "value": "y"}]  # fmt: skip
    assert store.patch(configmaps, "ns", "c", JSON_PATCH, fresh)["data"] == {"k": "1", "x": "y"}
    with pytest.raises(ApiError) as exc:
        store.patch(configmaps, "ns", "c", "application/yaml", {})
    assert exc.value.code == 415


def test_no_op_write_keeps_the_resource_version(store: Store) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    store.create(configmaps, "ns", {"metadata": {"name": "c"}, "data": {"k": "1"}})
    before = store.resource_version
    store.patch(configmaps, "ns", "c", MERGE_PATCH, {"data": {"k": "1"}})
    assert store.resource_version == before


def test_finalizers_hold_deletion_until_released(store: Store) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    store.create(configmaps, "ns", {"metadata": {"name": "c", "finalizers": ["kvpolicy.dev/x", "other"]}})
    marked = store.delete(configmaps, "ns", "c")
    assert marked["metadata"]["deletionTimestamp"]
    assert store.delete(configmaps, "ns", "c")["metadata"]["resourceVersion"] == marked["metadata"]["resourceVersion"]
    store.patch(configmaps, "ns", "c", MERGE_PATCH, {"metadata": {"finalizers": ["other"]}})
    assert store.find(configmaps, "ns", "c") is not None
    store.patch(configmaps, "ns", "c", MERGE_PATCH, {"metadata": {"finalizers": None}})
    assert store.find(configmaps, "ns", "c") is None
    assert [event.type for event in store.events_since(0)][-3:] == ["MODIFIED", "MODIFIED", "DELETED"]


def test_owner_deletion_collects_dependents_unless_orphaned(store: Store) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    owner = store.create(configmaps, "ns", {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    store.create(configmaps, "ns", {"metadata": {"name": "child", "ownerReferences": [ref]}})
    grandchild_ref = {**ref, "name": "child", "uid": store.get(configmaps, "ns", "child")["metadata"]["uid"]}
    store.create(configmaps, "ns", {"metadata": {"name": "grandchild", "ownerReferences": [grandchild_ref]}})
    store.create(configmaps, "ns", {"metadata": {"name": "bystander"}})
    store.delete(configmaps, "ns", "owner")
    assert [obj["metadata"]["name"] for obj in store.list_objects(configmaps, "ns")] == ["bystander"]

    owner = store.create(configmaps, "ns", {"metadata": {"name": "owner"}})
    ref["uid"] = owner["metadata"]["uid"]
    store.create(configmaps, "ns", {"metadata": {"name": "child", "ownerReferences": [ref]}})
    store.delete(configmaps, "ns", "owner", propagation="Orphan")
    assert store.find(configmaps, "ns", "child") is not None


def test_namespace_deletion_removes_its_objects(store: Store) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    store.create(configmaps, "ns", {"metadata": {"name": "c"}})
    store.delete(store.type_for("v1", "Namespace"), None, "ns")
    assert store.list_objects(configmaps) == []


def test_crd_registration_serves_the_resource_and_deletion_unserves_it(store: Store) -> None:
    widgets = widget_type(store)
    crds = store.type_for("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    crd = store.get(crds, None, "widgets.example.dev")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]} == {"NamesAccepted": "True",
                                                                           "Established": "True"}  # fmt: skip
    assert widgets.short_names == ("wdg",) and widgets.has_status
    store.create(widgets, "ns", {"metadata": {"name": "w"}})
    store.delete(crds, None, "widgets.example.dev")
    with pytest.raises(ApiError) as exc:
        store.find_type("example.dev", "v1", "widgets")
    assert exc.value.code == 404
    with pytest.raises(ApiError, match="lacks spec field") as exc:
        store.create(crds, None, {"metadata": {"name": "broken"}, "spec": {"group": "x"}})
    assert exc.value.code == 422


def test_event_log_replays_from_a_resource_version_and_expires(store: Store, monkeypatch) -> None:
    configmaps = store.type_for("v1", "ConfigMap")
    start = store.resource_version
    for index in range(3):
        store.create(configmaps, "ns", {"metadata": {"name": f"c{index}"}})
    events = store.events_since(start + 1)
    assert [(event.type, event.obj["metadata"]["name"]) for event in events] == [("ADDED", "c1"), ("ADDED", "c2")]
    monkeypatch.setattr("kvpolicy_dev.devcluster.store.EVENT_LOG_LIMIT", 2)
    store.create(configmaps, "ns", {"metadata": {"name": "c3"}})
    with pytest.raises(ApiError) as exc:
        store.events_since(start)
    assert (exc.value.code, exc.value.reason) == (410, "Expired")


def test_merge_patch_follows_rfc_7386() -> None:
    target = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert merge_patch(target, {"a": {"b": None, "d": 3}, "l": [3]}) == {"a": {"c": 2, "d": 3}, "l": [3]}
    assert target == {"a": {"b": 1, "c": 2}, "l": [1, 2]}


def test_strategic_merge_patch_merges_lists_by_the_key_kubectl_names() -> None:
    live = {"spec": {"containers": [
        {"name": "vllm", "image": "v:1", "env": [{"name": "A", "value": "1"}], "args": ["serve", "m"]},
        {"name": "sidecar", "image": "s:1"},
    ], "finalizers": ["a", "b"], "tolerations": [{"key": "x"}]}}  # fmt: skip
    patch = {"spec": {
        "$setElementOrder/containers": [{"name": "sidecar"}, {"name": "vllm"}, {"name": "proxy"}],
        "containers": [{"name": "vllm", "image": "v:2", "env": [{"name": "B", "value": "2"}],
                        "$setElementOrder/env": [{"name": "A"}, {"name": "B"}]},
                       {"name": "proxy", "image": "p:1"}],
        "$deleteFromPrimitiveList/finalizers": ["a"],
        "tolerations": [{"key": "y"}],
    }}  # fmt: skip
    merged = strategic_merge_patch(live, patch)["spec"]
    assert [c["name"] for c in merged["containers"]] == ["sidecar", "vllm", "proxy"]
    vllm = merged["containers"][1]
    assert vllm["image"] == "v:2" and vllm["args"] == ["serve", "m"]  # fields the patch does not name survive
    assert vllm["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    assert merged["finalizers"] == ["b"] and merged["tolerations"] == [{"key": "y"}]  # no directive: replaced
    removal = {"spec": {"containers": [{"name": "sidecar", "$patch": "delete"}],
                        "$setElementOrder/containers": [{"name": "vllm"}]}}  # fmt: skip
    assert [c["name"] for c in strategic_merge_patch(live, removal)["spec"]["containers"]] == ["vllm"]
    assert strategic_merge_patch(live, {"spec": {"$patch": "replace", "x": 1}}) == {"spec": {"x": 1}}
