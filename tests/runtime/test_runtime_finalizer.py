"""Deletion is the policy's loop's own work (runtime/reconciler.py `FINALIZER`, `finalize`): the first pass holds the
deletion before it can make a child, and a policy being deleted gets its children removed, a `Deleted` event and
its deletion released by its loop. kopf ran this as an on.delete handler, which cost every policy a PATCH of kopf's
last-handled state and a JSON diff of its whole body on each watch event (issue 28)."""

from __future__ import annotations

import asyncio
from typing import Any

from fake_kube import FakeKubeApi
from kvpolicy.api.v1alpha1 import API_VERSION
from kvpolicy.kube.api import DEPLOYMENTS, KVPOLICIES, ApiError
from kvpolicy.runtime import handlers
from kvpolicy.runtime.reconciler import FINALIZER, Reconciler
from operator_helpers import CONFIG, NAMESPACE, target_deployment
from test_runtime_loops import raw_policy, until

OTHER = "example.com/keep-until-archived"


def being_deleted(name: str, finalizers: list[str]) -> dict[str, Any]:
    raw = raw_policy(name)
    raw["metadata"].update(deletionTimestamp="2026-01-01T01:00:00Z", finalizers=finalizers)
    return raw


def canary_of(name: str) -> dict[str, Any]:
    canary = target_deployment()
    canary["metadata"].update(
        name=f"{name}-canary-g1",
        labels={"kvpolicy.dev/policy": name},
        ownerReferences=[{"apiVersion": API_VERSION, "kind": "KVPolicy", "name": name, "uid": f"uid-{name}"}],
    )
    return canary


def stored(api: FakeKubeApi, name: str) -> dict[str, Any] | None:
    return api.objects.get(("kvpolicies", NAMESPACE, name))


async def test_the_first_pass_holds_the_deletion_before_anything_else_is_written() -> None:
    api = FakeKubeApi()
    raw = raw_policy("a")
    raw["metadata"]["finalizers"] = [OTHER]
    api.put(KVPOLICIES, NAMESPACE, raw)
    target = target_deployment()
    target["metadata"]["name"] = "a"
    api.put(DEPLOYMENTS, NAMESPACE, target)
    reconciler = Reconciler(api, CONFIG)
    await reconciler.reconcile_once(NAMESPACE, "a")
    policy = stored(api, "a")
    assert policy is not None and policy["metadata"]["finalizers"] == [OTHER, FINALIZER], "another's kept"
    writes = [call for call in api.calls if not call.startswith(("get", "list"))]
    assert writes[0] == "patch kvpolicies", writes
    api.calls.clear()
    await reconciler.reconcile_once(NAMESPACE, "a")
    assert api.calls.count("patch kvpolicies") == 1, "held once: the next pass writes only its status"


async def test_a_policy_being_deleted_is_cleaned_up_said_and_released_by_its_loop() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, being_deleted("a", [OTHER, FINALIZER]))
    api.put(DEPLOYMENTS, NAMESPACE, canary_of("a"))
    reconciler = Reconciler(api, CONFIG)
    assert await reconciler.reconcile_once(NAMESPACE, "a") is None, "the loop ends"
    assert ("deployments", NAMESPACE, "a-canary-g1") not in api.objects
    policy = stored(api, "a")
    assert policy is not None and policy["metadata"]["finalizers"] == [OTHER], "only its own finalizer removed"
    assert [(event["reason"], event["type"]) for event in api.events] == [("Deleted", "Normal")]
    assert "children removed" in api.events[0]["message"]


async def test_a_cleanup_failure_that_may_pass_is_retried_and_the_deletion_then_released() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, being_deleted("a", [FINALIZER]))
    api.put(DEPLOYMENTS, NAMESPACE, canary_of("a"))
    reconciler = Reconciler(api, CONFIG.__class__(**{**CONFIG.__dict__, "poll_seconds": 0.02}))
    api.fail["delete"] = ApiError(503, "ServiceUnavailable", "busy")
    reconciler.start(NAMESPACE, "a", "uid-a")
    await until(lambda: not reconciler.running("uid-a"), "the loop to finish the deletion")
    policy = stored(api, "a")
    assert policy is not None and policy["metadata"]["finalizers"] == []
    assert ("deployments", NAMESPACE, "a-canary-g1") not in api.objects
    assert [event["reason"] for event in api.events] == ["Deleted"], "said once, after the retry"


async def test_a_refused_cleanup_is_said_and_does_not_hold_the_deletion_for_ever() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, being_deleted("a", [FINALIZER]))
    api.put(DEPLOYMENTS, NAMESPACE, canary_of("a"))
    api.fail["delete"] = ApiError(403, "Forbidden", "deployments is forbidden")
    reconciler = Reconciler(api, CONFIG)
    assert await reconciler.reconcile_once(NAMESPACE, "a") is None
    policy = stored(api, "a")
    assert policy is not None and policy["metadata"]["finalizers"] == []
    assert [(event["reason"], event["type"]) for event in api.events] == [("APIRequestRejected", "Warning")]
    assert "deployments is forbidden" in api.events[0]["message"]


async def test_a_policy_without_the_finalizer_is_left_to_the_api_server() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, being_deleted("a", [OTHER]))
    reconciler = Reconciler(api, CONFIG)
    assert await reconciler.reconcile_once(NAMESPACE, "a") is None
    assert api.events == [] and [call for call in api.calls if not call.startswith("get")] == []


async def test_the_watch_starts_a_loop_for_a_held_deletion_only() -> None:
    """A policy whose deletion began while no operator ran still carries the finalizer: its first event (the initial
    list) starts a loop that finalizes it. One being deleted without it needs nothing from the operator."""
    api = FakeKubeApi()
    reconciler = Reconciler(api, CONFIG)
    memo = {"reconciler": reconciler}
    for name, finalizers in (("held", [FINALIZER]), ("free", [OTHER])):
        body = being_deleted(name, finalizers)
        api.put(KVPOLICIES, NAMESPACE, body)
        await handlers.watched(body=body, event={"type": "MODIFIED", "object": body}, memo=memo)
    assert reconciler.running("uid-held") and not reconciler.running("uid-free")
    await until(lambda: not reconciler.running("uid-held"), "the held deletion to be finalized")
    policy = stored(api, "held")
    assert policy is not None and policy["metadata"]["finalizers"] == []
    await asyncio.sleep(0)
