"""Lists answered from watches (kube/cached.py) against the dev cluster: following adds, changes and deletes,
bookmarks, a 410 or a failing watch (lists fall back to the API server meanwhile), and what is never cached."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from e2e_helpers import KVP, policy, until
from kvpolicy.api import crd
from kvpolicy.kube import cached
from kvpolicy.kube.api import DEPLOYMENTS, KVPOLICIES, NODES, SERVICES, FieldEquals, KubernetesApi
from kvpolicy.kube.cached import CachedKubeApi, Informer, Selection, equality_terms, operator_selections
from kvpolicy.kube.login import ClusterLogin
from kvpolicy.rollout.ownership import TARGET_NAME_PATH
from kvpolicy_dev.devcluster import ThreadedDevCluster

TEAM = "example.com/team"


def service(name: str, team: str | None) -> dict[str, Any]:
    labels = {TEAM: team} if team else {}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"selector": {"app": name}, "ports": [{"port": 80}]},
    }


@pytest_asyncio.fixture(loop_scope="function")  # the tests' own loop; the cluster runs on its own thread
async def api(devcluster: ThreadedDevCluster) -> AsyncIterator[CachedKubeApi]:
    """The operator's selections, and the Services labelled with a team."""
    selections = {**operator_selections("kvpolicy.dev/policy"), SERVICES: Selection(TEAM, namespaced=True)}
    client = CachedKubeApi(await KubernetesApi.connect(ClusterLogin.discover(devcluster.environ())), selections)
    yield client
    await client.close()


async def until_listed(api: CachedKubeApi, namespace: str, selector: str, expected: list[str]) -> None:
    """Wait until listing `selector` gives the `expected` names (a cache follows its watch by an event)."""
    for _ in range(200):
        if await names(api, namespace, selector) == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{selector} never listed {expected}: {await names(api, namespace, selector)}")


def lists_sent(devcluster: ThreadedDevCluster, plural: str) -> int:
    """Plain (not watch) lists of `plural` the API server has answered."""
    requests = devcluster.call(lambda: list(devcluster.cluster.api))
    return sum(
        1
        for r in requests
        if r.method.value == "GET" and r.url.path.endswith(f"/{plural}") and r.params.get("watch") is None
    )


async def names(api: CachedKubeApi, namespace: str, selector: str) -> list[str]:
    return [obj["metadata"]["name"] for obj in await api.list_objects(SERVICES, namespace, selector)]


async def test_a_synced_informer_answers_lists_and_follows_changes(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, api: CachedKubeApi
) -> None:
    ns = devcluster_namespace
    devcluster.create({**service("a", "red"), "metadata": {**service("a", "red")["metadata"], "namespace": ns}})
    assert await names(api, ns, f"{TEAM}=red") == ["a"], "answered by the API server while the informer starts"
    informer = api.informer(SERVICES, ns)
    assert informer is not None
    await until(lambda: informer.synced, "the informer to sync")
    before = lists_sent(devcluster, "services")
    assert await api.create(SERVICES, ns, service("b", "red")) is True
    assert await api.create(SERVICES, ns, service("c", "blue")) is True
    assert await api.create(SERVICES, ns, service("d", None)) is True
    await until_listed(api, ns, f"{TEAM}=red", ["a", "b"])
    assert await names(api, ns, f"{TEAM}=blue") == ["c"]
    await api.patch(SERVICES, ns, "a", {"metadata": {"labels": {TEAM: "blue"}}})
    await api.delete(SERVICES, ns, "b")
    await until_listed(api, ns, f"{TEAM}=blue", ["a", "c"])
    await until_listed(api, ns, f"{TEAM}=red", [])
    assert lists_sent(devcluster, "services") == before, "no list reached the API server once synced"


async def test_lists_an_informer_cannot_answer_go_to_the_api_server(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, api: CachedKubeApi
) -> None:
    ns = devcluster_namespace
    await api.create(SERVICES, ns, service("a", "red"))
    await names(api, ns, f"{TEAM}=red")
    informer = api.informer(SERVICES, ns)
    assert informer is not None
    await until(lambda: informer.synced, "the informer to sync")
    before = lists_sent(devcluster, "services")
    assert await names(api, ns, "") == ["a"], "no selector: not the cached selection"
    assert await names(api, ns, f"{TEAM} in (red)") == ["a"], "set-based terms are the API server's to evaluate"
    assert await names(api, ns, f"{TEAM}!=blue") == ["a"]
    assert await api.list_objects(DEPLOYMENTS, ns, f"{TEAM}=red") == [], "not a cached resource"
    assert lists_sent(devcluster, "services") == before + 3
    assert api.informer(DEPLOYMENTS, ns) is None


async def test_nodes_are_cached_as_their_metadata(devcluster: ThreadedDevCluster, api: CachedKubeApi) -> None:
    selector = "kvpolicy.dev/node-pool=h200"
    fresh = await api.list_objects(NODES, None, selector)
    informer = api.informer(NODES, None)
    assert informer is not None
    await until(lambda: informer.synced, "the node informer to sync")
    cached_nodes = await api.list_objects(NODES, None, selector)
    assert [node["metadata"] for node in cached_nodes] == [node["metadata"] for node in fresh]
    assert all(set(node) == {"apiVersion", "kind", "metadata"} for node in cached_nodes), "status is not kept"


async def test_ownership_is_read_from_a_cache_even_since_a_policy_was_written(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, api: CachedKubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every policy's pass reads which policy governs its target: N policies would cost N lists of N per period. A
    rollout's first pass needs every policy written before its own spec: the cache answers it once it holds that
    policy at that generation (a watch is in write order), and the API server only when the watch lags too long."""
    ns = devcluster_namespace
    devcluster.apply(crd.crd_object())
    devcluster.create(policy(ns, name="first"))
    await api.list_objects(KVPOLICIES, ns)
    informer = api.informer(KVPOLICIES, ns)
    assert informer is not None
    await until(lambda: informer.synced, "the KVPolicy informer to sync")
    second = devcluster.create(policy(ns, name="second"))
    before = lists_sent(devcluster, "kvpolicies")
    peers = await api.list_objects(KVPOLICIES, ns, since=second)  # may wait for the watch, never lists
    assert [peer["metadata"]["name"] for peer in peers] == ["first", "second"]
    assert lists_sent(devcluster, "kvpolicies") == before, "answered from the cache"
    [kept, _] = await api.list_objects(KVPOLICIES, ns)
    assert set(kept) == {"metadata", "spec"} and set(kept["spec"]) == {"targetRef"}, "only what ownership reads"
    assert set(kept["metadata"]) == {"name", "namespace", "uid", "generation", "creationTimestamp"}

    edited = devcluster.patch(*KVP, "second", {"spec": {"targetRef": {"name": "other"}}}, ns)
    assert edited["metadata"]["generation"] == 2
    newer = await api.list_objects(KVPOLICIES, ns, since=edited)
    assert newer[1]["spec"]["targetRef"]["name"] == "other", "the cache at the edit's generation"
    assert lists_sent(devcluster, "kvpolicies") == before

    monkeypatch.setattr(cached, "SINCE_WAIT_SECONDS", 0.0)
    ahead = {"metadata": {**edited["metadata"], "generation": 3}}  # a generation the watch has not brought
    assert len(await api.list_objects(KVPOLICIES, ns, since=ahead)) == 2
    assert lists_sent(devcluster, "kvpolicies") == before + 1, "the API server answers what the cache cannot"


async def test_a_quiet_watch_gets_bookmarks_with_the_latest_version(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, api: CachedKubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch that matches nothing still learns how far the server got, so resuming it replays nothing and does not
    fall out of the server's event window."""
    devcluster.call(setattr, devcluster.cluster.api, "bookmark_seconds", 0.2)
    try:
        start = (await api.api.list_collection(SERVICES, devcluster_namespace, f"{TEAM}=none"))["metadata"]
        await api.api.create(SERVICES, devcluster_namespace, service("other", "red"))  # not in the selection
        latest = devcluster.call(lambda: devcluster.cluster.api.store.resource_version)
        events = api.api.watch(SERVICES, devcluster_namespace, f"{TEAM}=none", start["resourceVersion"], 5)
        async for event_type, obj in events:
            assert event_type == "BOOKMARK", obj
            assert int(obj["metadata"]["resourceVersion"]) >= latest
            break
    finally:
        devcluster.call(setattr, devcluster.cluster.api, "bookmark_seconds", 1.0)


async def synced_informer(api: CachedKubeApi, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Informer:
    monkeypatch.setattr(cached, "WATCH_SECONDS", 1)  # the server ends each watch after a second: it is resumed
    monkeypatch.setattr(cached, "RETRY_SECONDS", 0.1)
    await names(api, namespace, f"{TEAM}=red")
    informer = api.informer(SERVICES, namespace)
    assert informer is not None
    await until(lambda: informer.synced, "the informer to sync")
    return informer


@pytest.mark.parametrize(("code", "times"), [(410, 1), (500, 2)])
async def test_a_failed_watch_lists_again_and_follows_on(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    api: CachedKubeApi,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
    times: int,
) -> None:
    """410 Gone (the version fell out of the server's window): list again at once; anything else: after a pause."""
    ns = devcluster_namespace
    informer = await synced_informer(api, ns, monkeypatch)
    fault = devcluster.fail_next(times, code, method="GET", resource="services", namespace=ns)
    await until(lambda: devcluster.call(lambda: fault.hits) == times, "the resumed watch to fail", within=15)
    await api.create(SERVICES, ns, service("late", "red"))
    await until_listed(api, ns, f"{TEAM}=red", ["late"])
    await until(lambda: informer.synced, "the informer to list again")
    lists_before = lists_sent(devcluster, "services")
    await until_listed(api, ns, f"{TEAM}=red", ["late"])
    assert lists_sent(devcluster, "services") == lists_before, "the cache answers again, and has what came since"


async def test_while_an_informer_is_not_synced_lists_go_to_the_api_server(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, api: CachedKubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = devcluster_namespace
    informer = await synced_informer(api, ns, monkeypatch)
    monkeypatch.setattr(cached, "RETRY_SECONDS", 3.0)  # the pause after a failure, before listing again
    fault = devcluster.fail_next(1, 500, method="GET", resource="services", namespace=ns)
    await until(lambda: devcluster.call(lambda: fault.hits) == 1, "the resumed watch to fail", within=15)
    await until(lambda: not informer.synced, "the informer to notice")
    lists_before = lists_sent(devcluster, "services")
    await api.create(SERVICES, ns, service("late", "red"))
    assert await names(api, ns, f"{TEAM}=red") == ["late"], "the API server answered, up to date"
    assert lists_sent(devcluster, "services") == lists_before + 1 and not informer.synced
    await until(lambda: informer.synced, "the informer to list again")
    assert await names(api, ns, f"{TEAM}=red") == ["late"]


def test_only_equality_selectors_are_answered_from_a_cache() -> None:
    assert equality_terms("a=b,c.io/d=e") == {"a": "b", "c.io/d": "e"}
    assert equality_terms("") == {}
    for selector in ("a!=b", "a==b", "a in (b)", "a", "!a"):
        assert equality_terms(selector) is None, selector


class ScriptedApi:
    """`list_collection` and `watch` for an `Informer`, from a list of objects and a queue of watch events."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.events: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

    async def list_collection(self, resource: Any, namespace: str | None, label_selector: str = "") -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "1"}, "items": self.items}

    async def watch(self, *args: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        while True:
            yield await self.events.get()


def claim(name: str, target: str, generation: int = 1, phase: str = "Planning") -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": generation, "resourceVersion": "2"}
    return {"metadata": meta, "spec": {"targetRef": {"name": target}}, "status": {"phase": phase}}


async def test_policies_naming_a_target_are_found_without_looking_at_every_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each policy's pass asks which policies name its target: with N policies, looking at each of them on every
    pass cost N per pass (5,000 policies: the operator at a full core). The informer indexes the target's name, and
    follows renames and deletions; a write to what it does not keep (a status) changes nothing there."""
    scripted = ScriptedApi([claim(f"p{index}", f"model-{index % 50}") for index in range(200)])
    selection = operator_selections("kvpolicy.dev/policy")[KVPOLICIES]
    informer = Informer(scripted, KVPOLICIES, "ns", None, selection.keep, selection.indexed)  # type: ignore[arg-type]
    informer.start()
    try:
        await until(lambda: informer.synced, "the informer to list")
        looked_at = []
        holds = FieldEquals.holds
        monkeypatch.setattr(FieldEquals, "holds", lambda self, obj: looked_at.append(obj) or holds(self, obj))
        where = FieldEquals(TARGET_NAME_PATH, "model-7")
        assert [p["metadata"]["name"] for p in informer.select({}, where)] == ["p107", "p157", "p57", "p7"]
        assert looked_at == [], "answered from the index"

        renamed = informer._changed
        await scripted.events.put(("MODIFIED", claim("p7", "model-8", generation=2)))
        await scripted.events.put(("DELETED", claim("p57", "model-7")))
        await until(lambda: renamed.is_set(), "the informer to follow")
        await until(lambda: len(informer.select({}, where)) == 2, "the rename and the deletion")
        assert [p["metadata"]["name"] for p in informer.select({}, where)] == ["p107", "p157"]
        assert "p7" in [p["metadata"]["name"] for p in informer.select({}, FieldEquals(TARGET_NAME_PATH, "model-8"))]

        quiet = informer._changed
        await scripted.events.put(("MODIFIED", claim("p107", "model-7", phase="HeldBF16")))
        await scripted.events.put(("ADDED", claim("late", "model-7")))
        await until(lambda: len(informer.select({}, where)) == 3, "the new policy")
        assert quiet.is_set(), "the addition woke waiters"
        brute = [obj for obj in informer.select({}) if holds(where, obj)]
        assert informer.select({}, where) == brute
    finally:
        await informer.stop()


async def test_a_status_write_does_not_count_as_a_change_of_the_ownership_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A policy's status writes (several per pass) leave what ownership reads as it was: they must not make every
    pass sort the namespace's policies again, nor wake the passes waiting for a policy's generation."""
    scripted = ScriptedApi([claim("a", "model")])
    selection = operator_selections("kvpolicy.dev/policy")[KVPOLICIES]
    informer = Informer(scripted, KVPOLICIES, "ns", None, selection.keep, selection.indexed)  # type: ignore[arg-type]
    informer.start()
    try:
        await until(lambda: informer.synced, "the informer to list")
        touches: list[None] = []
        touched = informer._touched
        monkeypatch.setattr(informer, "_touched", lambda: touches.append(None) or touched())
        await scripted.events.put(("MODIFIED", claim("a", "model", phase="HeldBF16")))
        await scripted.events.put(("ADDED", claim("b", "model")))
        await until(lambda: len(informer.select({})) == 2, "the addition")
        assert len(touches) == 1, "the status write changed nothing"
        await scripted.events.put(("MODIFIED", claim("a", "model", generation=2)))
        await until(lambda: informer.holds(claim("a", "model", generation=2)), "the spec change")
        assert len(touches) == 2
    finally:
        await informer.stop()
