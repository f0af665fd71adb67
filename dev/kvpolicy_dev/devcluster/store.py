"""The state of the emulated cluster: objects, resource versions, the event log watches replay, deletion and GC.

Everything here is synchronous and runs on the cluster's event loop, so each operation is atomic. Stored objects are
never mutated in place: every write stores a fresh dict, so the event log can keep references to old states.
Callers must treat returned objects as read-only (the `DevCluster` facade hands out copies).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import secrets
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jsonpatch

from kvpolicy_dev.devcluster import openapi, podsecurity
from kvpolicy_dev.devcluster.resources import (
    BUILTIN_TYPES,
    CRD_GROUP,
    CRD_PLURAL,
    CRDError,
    ResourceType,
    types_from_crd,
)
from kvpolicy_dev.devcluster.selectors import Selector
from kvpolicy_dev.devcluster.validation import FieldError, generated_name_base, validate

Obj = dict[str, Any]
ObjectKey = tuple[str, str]  # (namespace or "", name)

# Watches may resume from any resourceVersion still in the log; older ones get 410 Gone, as on a real API server.
EVENT_LOG_LIMIT = 10_000

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


class ApiError(Exception):
    """An API failure, rendered as a Kubernetes `Status` object."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def not_found(rt: ResourceType, name: str) -> ApiError:
    qualified = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
    details = {"name": name, "group": rt.group, "kind": rt.plural}
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found', details)


def conflict(rt: ResourceType, name: str) -> ApiError:
    qualified = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
    message = (
        f'Operation cannot be fulfilled on {qualified} "{name}": '
        "the object has been modified; please apply your changes to the latest version and try again"
    )
    return ApiError(409, "Conflict", message, {"name": name, "group": rt.group, "kind": rt.plural})


def invalid(rt: ResourceType, obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> ApiError | None:
    """422 Invalid, as kube-apiserver words it, for a name, labels, or (custom resources) a schema or CEL rule it would
    refuse; None when the object is valid. An update (`old` given) ratchets like kube-apiserver since 1.30: a value
    left as it was is not refused for rules it broke already (an object stored before a stricter CRD stays
    writable, and deletable)."""
    errors = validate(rt.kind, obj, creating=old is None)
    if rt.schema is not None:
        body = {key: value for key, value in obj.items() if key not in ("apiVersion", "kind", "metadata")}
        found = openapi.schema_errors(body, _without_metadata(rt.schema), "")
        errors += [e for e in found if old is None or openapi.value_at(obj, e.field) != openapi.value_at(old, e.field)]
    if rt.key == (CRD_GROUP, CRD_PLURAL):
        errors += _crd_default_errors(obj)
    if not errors:
        return None
    name = str((obj.get("metadata") or {}).get("name") or "")
    qualified = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
    listed = str(errors[0]) if len(errors) == 1 else f"[{', '.join(map(str, errors))}]"
    details = {"name": name, "group": rt.group, "kind": rt.kind, "causes": [error.cause() for error in errors]}
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {listed}', details)


def _without_metadata(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The schema minus the fields the API server owns (validated by `validate`, whatever the CRD says of them)."""
    properties = {
        k: v for k, v in (schema.get("properties") or {}).items() if k not in ("apiVersion", "kind", "metadata")
    }
    return {**schema, "properties": properties}


def _crd_default_errors(crd: Mapping[str, Any]) -> list[FieldError]:
    errors: list[FieldError] = []
    for index, version in enumerate((crd.get("spec") or {}).get("versions") or ()):
        schema = ((version or {}).get("schema") or {}).get("openAPIV3Schema")
        if isinstance(schema, Mapping):
            errors += openapi.default_errors(schema, f"spec.versions[{index}].schema.openAPIV3Schema")
    return errors


def defaulted(rt: ResourceType, obj: Obj) -> Obj:
    """The object with its CRD's structural defaults applied, as kube-apiserver does before validating it."""
    if rt.schema is None:
        return obj
    return dict(openapi.apply_defaults(obj, _without_metadata(rt.schema)))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge, `null` deletes, anything else (lists too) replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch as kubectl sends one, without Go's type schemas.

    kubectl names the merge key of every list it merges in a `$setElementOrder/LIST` directive (`[{"name": ...}]`),
    so lists with one are merged by that key (`$patch: delete` items removed) and put in that order; other lists
    are replaced. `$deleteFromPrimitiveList/LIST` and `$patch: replace` are honoured too.
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    content = {key: value for key, value in patch.items() if not key.startswith("$")}
    if patch.get("$patch") == "replace":
        return copy.deepcopy(content)
    orders = {key.split("/", 1)[1]: value for key, value in patch.items() if key.startswith("$setElementOrder/")}
    removals = {key.split("/", 1)[1]: v for key, v in patch.items() if key.startswith("$deleteFromPrimitiveList/")}
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in content.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in orders:
            result[key] = _merge_list(result.get(key) or [], value, orders[key])
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    for key, order in orders.items():
        if key not in content and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], [], order)
    for key, removed in removals.items():
        result[key] = [item for item in result.get(key) or [] if item not in removed]
    return result


def _merge_list(current: list[Any], patch_items: list[Any], order: list[Any]) -> list[Any]:
    if not all(isinstance(entry, Mapping) and len(entry) == 1 for entry in order):
        # Primitives: the directive lists the final contents in order.
        return [item for item in order if item in current or item in patch_items]
    merge_key = next(iter(order[0])) if order else "name"
    by_key = {item.get(merge_key): item for item in current if isinstance(item, Mapping)}
    for item in patch_items:
        if item.get("$patch") == "delete":
            by_key.pop(item.get(merge_key), None)
        else:
            by_key[item.get(merge_key)] = strategic_merge_patch(by_key.get(item.get(merge_key)), item)
    ordered = [by_key.pop(entry[merge_key]) for entry in order if entry[merge_key] in by_key]
    return ordered + list(by_key.values())


def _spec_part(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What a generation counts: everything but metadata and status."""
    return {key: value for key, value in obj.items() if key not in ("metadata", "status")}


def now_timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class WatchEvent:
    resource_version: int
    type: str  # ADDED, MODIFIED or DELETED
    key: tuple[str, str]  # ResourceType.key
    obj: Obj
    old: Obj | None  # the previous state, so selector-filtered watches can turn MODIFIED into ADDED/DELETED


class Store:
    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._objects: dict[tuple[str, str], dict[ObjectKey, Obj]] = {}
        self._resource_version = 0
        self._log: list[WatchEvent] = []
        self._changed = asyncio.Event()
        for rt in BUILTIN_TYPES:
            self.register(rt)

    # --- resource types -------------------------------------------------------------------------------------------

    def register(self, rt: ResourceType) -> None:
        self._types[(rt.group, rt.version, rt.plural)] = rt
        self._objects.setdefault(rt.key, {})

    def types(self) -> list[ResourceType]:
        return list(self._types.values())

    def find_type(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self._types.get((group, version, plural))
        if rt is None:
            where = f"{group}/{version}" if group else version
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({where} {plural})")
        return rt

    def type_for(self, api_version: str, kind: str) -> ResourceType:
        group, _, version = api_version.rpartition("/")
        for rt in self._types.values():
            if (rt.group, rt.version, rt.kind) == (group, version, kind):
                return rt
        raise ApiError(404, "NotFound", f"no resource of kind {kind!r} is served in {api_version!r}")

    # --- reading --------------------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._resource_version

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self._objects[rt.key].get((namespace or "" if rt.namespaced else "", name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def find(self, rt: ResourceType, namespace: str | None, name: str) -> Obj | None:
        return self._objects[rt.key].get((namespace or "" if rt.namespaced else "", name))

    def list_objects(
        self,
        rt: ResourceType,
        namespace: str | None = None,
        label_selector: Selector | None = None,
        field_selector: Selector | None = None,
    ) -> list[Obj]:
        return [
            obj
            for (obj_namespace, _), obj in sorted(self._objects[rt.key].items())
            if namespace is None or not rt.namespaced or obj_namespace == namespace
            if label_selector is None or label_selector(obj)
            if field_selector is None or field_selector(obj)
        ]

    def all_objects(self) -> Iterator[tuple[ResourceType, Obj]]:
        preferred = {rt.key: rt for rt in self._types.values() if rt.preferred}
        for key, objects in self._objects.items():
            if key in preferred:
                for obj in list(objects.values()):
                    yield preferred[key], obj

    # --- watching -------------------------------------------------------------------------------------------------

    def events_since(self, resource_version: int) -> list[WatchEvent]:
        """Events after `resource_version`; 410 Gone when the log no longer reaches back that far."""
        first = self._log[0].resource_version if self._log else self._resource_version + 1
        if resource_version < first - 1:
            raise ApiError(410, "Expired", f"too old resource version: {resource_version} ({first - 1})")
        # Every write takes the next resource version, so the log is indexed by it.
        return self._log[max(0, resource_version - first + 1) :]

    async def wait_for_change(self, after_resource_version: int) -> None:
        """Return once a write newer than `after_resource_version` has happened."""
        if self._resource_version <= after_resource_version:
            await self._changed.wait()

    # --- writing --------------------------------------------------------------------------------------------------

    def create(self, rt: ResourceType, namespace: str | None, body: Mapping[str, Any]) -> Obj:
        obj: Obj = copy.deepcopy(dict(body))
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        if not metadata.get("name"):
            if not metadata.get("generateName"):
                raise ApiError(422, "Invalid", f"{rt.kind}: metadata.name or metadata.generateName is required")
            metadata["name"] = generated_name_base(metadata["generateName"]) + secrets.token_hex(3)[:5]
        name = metadata["name"]
        if rt.has_status:
            obj.pop("status", None)  # status is set via the status subresource only
        obj = defaulted(rt, obj)
        metadata = obj["metadata"]
        refused = invalid(rt, obj)
        if refused is not None:
            raise refused
        if rt.namespaced:
            namespace = namespace or metadata.get("namespace") or "default"
            if metadata.get("namespace") not in (None, "", namespace):
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the namespace of the URL")
            self._require_namespace(namespace)
            metadata["namespace"] = namespace
        else:
            metadata.pop("namespace", None)
        if self.find(rt, namespace, name) is not None:
            qualified = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
            raise ApiError(409, "AlreadyExists", f'{qualified} "{name}" already exists', {"name": name})
        if rt.key == ("", "pods"):
            self._admit_pod(str(namespace), name, obj)
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        metadata.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_timestamp())
        for transient in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            metadata.pop(transient, None)
        if rt.key == (CRD_GROUP, CRD_PLURAL):
            obj = self._accept_crd(obj)
        if rt.key == ("", "namespaces"):
            obj["status"] = {"phase": "Active"}
        return self._write(rt, obj, "ADDED")

    def replace(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
    ) -> Obj:
        old = self.get(rt, namespace, name)
        new: Obj = copy.deepcopy(dict(body))
        if new.get("metadata", {}).get("name", name) != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name in the URL")
        if subresource == "scale":
            return self._rescale(rt, old, new)
        return self._update(rt, old, new, subresource)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
    ) -> Obj:
        old = self.get(rt, namespace, name)
        target = self.scale(rt, namespace, name) if subresource == "scale" else old
        media_type = content_type.split(";")[0].strip()
        if media_type == JSON_PATCH:
            try:
                new = jsonpatch.apply_patch(target, patch)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error: {exc}") from exc
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError) as exc:
                raise ApiError(422, "Invalid", f"invalid JSON patch: {exc}") from exc
        elif media_type in (MERGE_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH):
            if not isinstance(patch, Mapping):
                raise ApiError(400, "BadRequest", f"a {media_type} body must be a JSON object")
            merge = strategic_merge_patch if media_type == STRATEGIC_MERGE_PATCH else merge_patch
            new = merge(copy.deepcopy(target), patch)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {media_type!r}")
        if subresource == "scale":
            return self._rescale(rt, old, new)
        return self._update(rt, old, new, subresource)

    def scale(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        """The autoscaling/v1 Scale view of a Deployment or ReplicaSet (what `kubectl scale` reads and writes)."""
        obj = self.get(rt, namespace, name)
        if "scale" not in rt.extra_subresources:
            raise ApiError(404, "NotFound", f"{rt.plural} has no subresource 'scale'")
        meta = obj["metadata"]
        match_labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                key: meta[key] for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            },
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 1)},
            "status": {
                "replicas": (obj.get("status") or {}).get("replicas", 0),
                "selector": ",".join(f"{key}={value}" for key, value in sorted(match_labels.items())),
            },
        }

    def _rescale(self, rt: ResourceType, old: Obj, scale: Mapping[str, Any]) -> Obj:
        self.scale(rt, old["metadata"].get("namespace"), old["metadata"]["name"])  # 404 unless scalable
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, "Invalid", f"Scale.spec.replicas must be a non-negative integer, not {replicas!r}")
        new = copy.deepcopy(old)
        new["spec"]["replicas"] = replicas
        new["metadata"]["resourceVersion"] = (scale.get("metadata") or {}).get("resourceVersion")
        updated = self._update(rt, old, new, None)
        return self.scale(rt, updated["metadata"].get("namespace"), updated["metadata"]["name"])

    def delete(self, rt: ResourceType, namespace: str | None, name: str, propagation: str = "Background") -> Obj:
        obj = self.get(rt, namespace, name)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return obj
            marked = copy.deepcopy(obj)
            marked["metadata"].update(deletionTimestamp=now_timestamp(), deletionGracePeriodSeconds=0)
            return self._write(rt, marked, "MODIFIED")
        return self._remove(rt, obj, orphan=propagation == "Orphan")

    # --- internals ------------------------------------------------------------------------------------------------

    def _admit_pod(self, namespace: str, name: str, pod: Obj) -> None:
        """Pod Security admission: a namespace labelled pod-security.kubernetes.io/enforce refuses pods below it."""
        labels = (self.get(self._types[("", "v1", "namespaces")], None, namespace)["metadata"].get("labels")) or {}
        level = labels.get(podsecurity.ENFORCE_LABEL, "privileged")
        problems = podsecurity.violations(level, pod.get("spec") or {}, pod["metadata"].get("annotations"))
        if problems:
            message = f'pods "{name}" is forbidden: violates PodSecurity "{level}:latest": {", ".join(problems)}'
            raise ApiError(403, "Forbidden", message, {"name": name, "kind": "pods"})

    def _require_namespace(self, namespace: str) -> None:
        if ("", namespace) not in self._objects[("", "namespaces")]:
            details = {"name": namespace, "kind": "namespaces"}
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found', details)

    def _update(self, rt: ResourceType, old: Obj, new: Obj, subresource: str | None) -> Obj:
        name = old["metadata"]["name"]
        if subresource not in (None, "status") or (subresource == "status" and not rt.has_status):
            raise ApiError(404, "NotFound", f"{rt.plural} has no subresource {subresource!r}")
        if not isinstance(new.get("metadata"), dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        expected_version = new["metadata"].get("resourceVersion")
        if expected_version not in (None, "", old["metadata"]["resourceVersion"]):
            raise conflict(rt, name)
        if subresource == "status":
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
            result = defaulted(rt, result)
            refused = invalid(rt, result, old)
            if refused is not None:
                raise refused
        else:
            result = new
            metadata = result["metadata"]
            for immutable in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "generation"):
                if immutable in old["metadata"]:
                    metadata[immutable] = old["metadata"][immutable]
                else:
                    metadata.pop(immutable, None)
            result["apiVersion"], result["kind"] = old["apiVersion"], old["kind"]
            if rt.has_status:
                if "status" in old:
                    result["status"] = old["status"]
                else:
                    result.pop("status", None)
            result = defaulted(rt, result)
            metadata = result["metadata"]
            refused = invalid(rt, result, old)
            if refused is not None:
                raise refused
            if _spec_part(result) != _spec_part(old):
                metadata["generation"] = old["metadata"].get("generation", 1) + 1
            if rt.key == (CRD_GROUP, CRD_PLURAL):
                result = self._accept_crd(result)
        if result["metadata"].get("deletionTimestamp") and not result["metadata"].get("finalizers"):
            return self._remove(rt, result, orphan=False)
        result["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if result == old:
            return old  # a no-op write keeps the resourceVersion and wakes no watch, as on a real API server
        return self._write(rt, result, "MODIFIED")

    def _accept_crd(self, crd: Obj) -> Obj:
        try:
            new_types = types_from_crd(crd)
        except CRDError as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        old_versions = [key for key, rt in self._types.items() if rt.key == new_types[0].key]
        for key in old_versions:
            del self._types[key]
        for rt in new_types:
            self.register(rt)
        crd = copy.deepcopy(crd)
        crd["status"] = {
            "acceptedNames": crd["spec"]["names"],
            "storedVersions": [rt.version for rt in new_types if rt.preferred],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found"},
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                },
            ],
        }
        return crd

    def _write(self, rt: ResourceType, obj: Obj, event_type: str) -> Obj:
        self._resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self._resource_version)
        objects = self._objects[rt.key]
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        old = objects.get(key)
        if event_type == "DELETED":
            objects.pop(key, None)
        else:
            objects[key] = obj
        self._log.append(WatchEvent(self._resource_version, event_type, rt.key, obj, old))
        if len(self._log) > EVENT_LOG_LIMIT:
            del self._log[: len(self._log) - EVENT_LOG_LIMIT]
        self.notify()
        return obj

    def notify(self) -> None:
        """Wake everything waiting in `wait_for_change`."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _remove(self, rt: ResourceType, obj: Obj, *, orphan: bool) -> Obj:
        removed = self._write(rt, copy.deepcopy(obj), "DELETED")
        if rt.key == ("", "namespaces"):
            self._delete_where(
                lambda other_rt, other: (
                    other_rt.namespaced and other["metadata"].get("namespace") == obj["metadata"]["name"]
                )
            )
        if rt.key == (CRD_GROUP, CRD_PLURAL):
            group, plural = obj["spec"]["group"], obj["spec"]["names"]["plural"]
            self._delete_where(lambda other_rt, _: other_rt.key == (group, plural))
            for key in [key for key, served in self._types.items() if served.key == (group, plural)]:
                del self._types[key]
            del self._objects[(group, plural)]
        if not orphan:
            uid = obj["metadata"]["uid"]
            self._delete_where(
                lambda _, other: any(ref.get("uid") == uid for ref in other["metadata"].get("ownerReferences", ()))
            )
        return removed

    def _delete_where(self, predicate: Callable[[ResourceType, Obj], bool]) -> None:
        """Delete (honouring finalizers) every object matching `predicate`: namespace cleanup and owner GC."""
        for rt, obj in list(self.all_objects()):
            if predicate(rt, obj):
                current = self.find(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"])
                if current is not None and current["metadata"]["uid"] == obj["metadata"]["uid"]:
                    self.delete(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"])
