"""The policies' loops (runtime/reconciler.py `start`/`stop`): one task per policy, started by its watch events, ended
by its deletion or the operator's exit, and nothing of it left behind once it ends (issue 28: thousands of policies
created and deleted)."""

from __future__ import annotations

import asyncio
from typing import Any

from fake_kube import FakeKubeApi
from kvpolicy.kube.api import DEPLOYMENTS, KVPOLICIES, REQUEST_CONNECTIONS, ApiError
from kvpolicy.runtime.reconciler import Reconciler
from operator_helpers import CONFIG, NAMESPACE, policy_spec, target_deployment


def raw_policy(name: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "generation": 1}
    meta["creationTimestamp"] = "2026-01-01T00:00:00Z"
    spec = policy_spec()
    spec["targetRef"] = {"name": name}
    return {"apiVersion": "kvpolicy.dev/v1alpha1", "kind": "KVPolicy", "metadata": meta, "spec": spec}


def per_policy_state(reconciler: Reconciler) -> dict[str, int]:
    """How many entries the reconciler keeps per policy, table by table."""
    tables = ("_loops", "_wake", "_generations", "_known", "_backing_off", "_waiting", "_changed")
    return {table: len(getattr(reconciler, table)) for table in tables}


async def until(check: Any, what: str) -> None:
    for _ in range(400):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_one_loop_per_policy_ended_by_the_deletion_leaves_nothing_behind() -> None:
    api = FakeKubeApi()
    reconciler = Reconciler(api, CONFIG)
    names = [f"model-{index}" for index in range(20)]
    for name in names:
        api.put(KVPOLICIES, NAMESPACE, raw_policy(name))
        target = target_deployment()
        target["metadata"]["name"] = name
        api.put(DEPLOYMENTS, NAMESPACE, target)
    for _ in range(3):  # every watch event starts the loop unless it runs
        for name in names:
            reconciler.start(NAMESPACE, name, f"uid-{name}")
    await until(lambda: api.calls.count("patch kvpolicies") >= len(names), "every first status")
    assert api.calls.count("get kvpolicies") == len(names), "one loop each"
    assert per_policy_state(reconciler)["_loops"] == len(names)

    for name in names:  # deleted: the watch's event wakes the loop, which sees the policy gone and ends
        del api.objects[("kvpolicies", NAMESPACE, name)]
        reconciler.notice(f"uid-{name}", 1, deleting=True)
    await until(lambda: not reconciler._loops, "every loop to end")
    for name in names:  # the DELETED events, after the loops ended
        reconciler.notice(f"uid-{name}", 1, deleting=True)
        reconciler.released(NAMESPACE, name)
    assert set(per_policy_state(reconciler).values()) == {0}, per_policy_state(reconciler)


async def test_a_stopped_loop_ends_at_once_and_is_not_started_twice_by_a_stop() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy("a"))
    reconciler = Reconciler(api, CONFIG.__class__(**{**CONFIG.__dict__, "poll_seconds": 1000.0}))
    api.fail["get"] = ApiError(503, "ServiceUnavailable", "busy")
    reconciler.start(NAMESPACE, "a", "uid-a")
    await until(lambda: "uid-a" in reconciler._backing_off, "the loop to back off (hundreds of seconds)")
    await asyncio.wait_for(reconciler.stop("uid-a"), 5)
    assert not reconciler.running("uid-a") and set(per_policy_state(reconciler).values()) == {0}
    await reconciler.stop("uid-a")  # a second stop finds nothing to do


async def test_a_spec_change_during_the_first_pass_ends_the_first_sleep() -> None:
    """The wake-up may come while the loop is in its first pass (the generation it read is already old)."""
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy("a"))
    reconciler = Reconciler(api, CONFIG.__class__(**{**CONFIG.__dict__, "idle_seconds": 1000.0}))
    original_get = api.get
    reads = 0

    async def get(*args: Any) -> Any:
        nonlocal reads
        reads += 1
        found = await original_get(*args)
        if reads == 1:
            reconciler._generations["uid-a"] = 1
            reconciler.notice("uid-a", 2, deleting=False)  # the edit's event, while the pass reads
        return found

    api.get = get  # type: ignore[method-assign]
    reconciler.start(NAMESPACE, "a", "uid-a")
    await until(lambda: reads >= 2, "a second pass at once")
    await reconciler.stop_all()
    assert not reconciler._loops


async def test_the_first_pass_starts_from_the_policy_the_event_brought() -> None:
    """Thousands of policies starting at once: no GET each for what the watch event already holds."""
    api = FakeKubeApi()
    policy = raw_policy("a")
    api.put(KVPOLICIES, NAMESPACE, policy)
    target = target_deployment()
    target["metadata"]["name"] = "a"
    api.put(DEPLOYMENTS, NAMESPACE, target)
    reconciler = Reconciler(api, CONFIG)
    reconciler.start(NAMESPACE, "a", "uid-a", policy)
    await until(lambda: "patch kvpolicies" in api.calls, "the first status")
    await reconciler.stop_all()
    assert "get kvpolicies" not in api.calls


async def test_passes_in_flight_are_as_many_as_the_client_has_connections() -> None:
    """Thousands of passes started together each hold their policy and observations while they queue for one of
    the client's connections: they wait for a turn before starting instead."""
    api = FakeKubeApi()
    reconciler = Reconciler(api, CONFIG)
    release = asyncio.Event()
    in_flight = 0
    most = 0

    async def get(*args: Any) -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await release.wait()
        in_flight -= 1
        return None  # gone: the loop ends

    api.get = get  # type: ignore[method-assign]
    for index in range(REQUEST_CONNECTIONS + 36):
        reconciler.start(NAMESPACE, f"p{index}", f"uid-{index}")
    await until(lambda: in_flight == REQUEST_CONNECTIONS, "the first passes")
    for _ in range(20):
        await asyncio.sleep(0)
    assert most == REQUEST_CONNECTIONS
    release.set()
    await until(lambda: not reconciler._loops, "every loop to end")
