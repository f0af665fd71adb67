"""Apply a step's result to the API: the actions in order, then the status, then the events.

Creates tolerate AlreadyExists and deletes NotFound, so a step replayed after a crash or a restart does nothing twice.
A request the API server refuses for good (422, 403, ...) does not stop the others: the deletes of a rollback still
free the canary's GPU when its other writes fail. Events are best-effort: a lost event never blocks a rollout.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpolicy.kube.api import (
    DEPLOYMENTS,
    HTTP_ROUTES,
    INFERENCE_POOLS,
    JOBS,
    KVPOLICIES,
    PODS,
    SERVICES,
    ApiError,
    KubeApi,
    Resource,
)
from kvpolicy.rollout.step_types import Action, Create, CustomKind, Delete, Event, Kind, ObjectKind, Patch, timestamp

logger = logging.getLogger(__name__)
Obj = dict[str, Any]

RESOURCES: dict[Kind, Resource] = {
    Kind.DEPLOYMENT: DEPLOYMENTS,
    Kind.SERVICE: SERVICES,
    Kind.JOB: JOBS,
    Kind.INFERENCE_POOL: INFERENCE_POOLS,
    Kind.HTTP_ROUTE: HTTP_ROUTES,
    Kind.POD: PODS,
}


def resource_for(kind: ObjectKind) -> Resource:
    """The API resource of a kind the step names (a target kind's custom resource by its group and plural)."""
    if isinstance(kind, CustomKind):
        return Resource(kind.group, kind.version, kind.plural)
    return RESOURCES[kind]


COMPONENT = "kvpolicy-operator"


class StaleObservationError(ApiError):
    """A JSON patch's test failed: the object changed since it was observed. Observe again, then retry."""

    def __init__(self, message: str) -> None:
        super().__init__(409, "Conflict", message)


@dataclass(frozen=True)
class Rejected:
    """An action the API server refused with an error another try cannot fix."""

    action: Action
    error: ApiError

    def describe(self) -> str:
        verb = {Create: "create", Patch: "patch", Delete: "delete"}[type(self.action)]
        name = self.action.name
        return f"the API server refused to {verb} {self.action.kind} {name}: {self.error}"


async def apply_actions(api: KubeApi, namespace: str, actions: Sequence[Action]) -> list[Rejected]:
    """Apply the actions in order. Errors that may pass (409, 429, 5xx, network) raise at once, so the pass is retried
    with fresh observations; the others are collected and returned after the remaining actions were applied."""
    rejected: list[Rejected] = []
    for action in actions:
        try:
            await _apply(api, namespace, action)
        except ApiError as error:
            if error.retryable:
                raise
            logger.warning("%s %s/%s refused: %s", action.kind, namespace, action.name, error)
            rejected.append(Rejected(action, error))
    return rejected


async def _apply(api: KubeApi, namespace: str, action: Action) -> None:
    if isinstance(action, Create):
        created = await api.create(resource_for(action.kind), namespace, action.body)
        logger.info("%s %s/%s %s", action.kind, namespace, action.name, "created" if created else "exists")
    elif isinstance(action, Delete):
        if await api.delete(resource_for(action.kind), namespace, action.name):
            logger.info("%s %s/%s deleted", action.kind, namespace, action.name)
    else:
        try:
            await api.patch(resource_for(action.kind), namespace, action.name, action.patch, action.patch_type)
        except ApiError as error:
            if action.patch_type == "json" and error.code == 422 and _failed_test(error):
                raise StaleObservationError(f"{action.kind} {action.name} changed: {error.message}") from error
            raise
        logger.info("%s %s/%s patched", action.kind, namespace, action.name)


def _failed_test(error: ApiError) -> bool:
    """A JSON patch's 422 means a `test` op failed (the object changed since it was observed) unless the API server
    refused the patched object itself, which it says as `<Kind> "<name>" is invalid: <field errors>`."""
    return " is invalid: " not in error.message


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> Obj:
    """The RFC 7386 merge patch turning `old` into `new` (removed keys become null; lists are replaced whole)."""
    patch: Obj = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif value != before:
            patch[key] = value
    return patch


async def write_status(api: KubeApi, policy: Obj, status: Obj) -> Obj | None:
    """Write the step's status through the /status subresource, sending only what changed. Returns the policy as
    the API server now has it (the same object when nothing changed), or None when it is gone."""
    patch = merge_patch(policy.get("status") or {}, status)
    if "kopf" in patch:  # kopf's own bookkeeping is not the step's business
        del patch["kopf"]
    if not patch:
        return policy
    meta = policy["metadata"]
    return await api.patch(KVPOLICIES, meta["namespace"], meta["name"], {"status": patch}, subresource="status")


def event_body(policy: Obj, event: Event, now: datetime) -> Obj:
    meta = policy["metadata"]
    moment = timestamp(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": policy.get("apiVersion", ""),
            "kind": policy.get("kind", ""),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": moment,
        "lastTimestamp": moment,
        "count": 1,
    }


async def post_events(api: KubeApi, policy: Obj, events: Sequence[Event], now: datetime) -> None:
    for event in events:
        log = logger.warning if event.type == "Warning" else logger.info
        log("%s/%s %s: %s", policy["metadata"]["namespace"], policy["metadata"]["name"], event.reason, event.message)
        try:
            await api.post_event(policy["metadata"]["namespace"], event_body(policy, event, now))
        except ApiError as error:
            logger.warning("could not post event %s: %s", event.reason, error)
