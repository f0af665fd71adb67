"""An in-memory `KubeApi` for unit tests of the executor, the observer and the reconciler."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
from kvpolicy.kube.api import ApiError, FieldEquals, PatchType, Resource

Obj = dict[str, Any]


def _matches(labels: Mapping[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, value = term.split("=", 1)
        if labels.get(key) != value:
            return False
    return True


@dataclass
class FakeKubeApi:
    objects: dict[tuple[str, str | None, str], Obj] = field(default_factory=dict)
    events: list[Obj] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # "verb plural", e.g. "get kvpolicies"
    fail: dict[str, Exception] = field(default_factory=dict)  # verb -> error raised once

    def put(self, resource: Resource, namespace: str | None, obj: Obj) -> None:
        self.objects[(resource.plural, namespace, obj["metadata"]["name"])] = copy.deepcopy(obj)

    def _maybe_fail(self, verb: str, resource: Resource | None = None) -> None:
        self.calls.append(f"{verb} {resource.plural}" if resource else verb)
        if verb in self.fail:
            raise self.fail.pop(verb)

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        self._maybe_fail("get", resource)
        found = self.objects.get((resource.plural, namespace, name))
        return copy.deepcopy(found) if found else None

    async def list_objects(
        self,
        resource: Resource,
        namespace: str | None,
        label_selector: str = "",
        since: Obj | None = None,
        where: FieldEquals | None = None,
    ) -> list[Obj]:
        self._maybe_fail("list", resource)
        return [
            copy.deepcopy(obj)
            for (plural, ns, _), obj in sorted(self.objects.items())
            if plural == resource.plural
            and (namespace is None or ns == namespace)
            and _matches(obj["metadata"].get("labels") or {}, label_selector)
            and (where is None or where.holds(obj))
        ]

    async def create(self, resource: Resource, namespace: str, body: Obj) -> bool:
        self._maybe_fail("create", resource)
        key = (resource.plural, namespace, body["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = copy.deepcopy(body)
        return True

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Obj | list[Obj],
        patch_type: PatchType = "merge",
        subresource: str | None = None,
    ) -> Obj | None:
        self._maybe_fail("patch", resource)
        key = (resource.plural, namespace, name)
        if key not in self.objects:
            return None
        if patch_type == "json":
            assert isinstance(patch, list)
            try:
                self.objects[key] = jsonpatch.apply_patch(self.objects[key], patch)
            except jsonpatch.JsonPatchTestFailed as error:
                raise ApiError(422, "Invalid", str(error)) from error
        else:
            assert isinstance(patch, dict)
            self.objects[key] = _merge(self.objects[key], patch)
        return copy.deepcopy(self.objects[key])

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        self._maybe_fail("delete", resource)
        return self.objects.pop((resource.plural, namespace, name), None) is not None

    async def post_event(self, namespace: str, body: Obj) -> None:
        self._maybe_fail("event")
        self.events.append(body)


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result
