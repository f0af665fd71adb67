"""The emulated API server over real HTTP: status codes, selectors, watches, faults, discovery, tables."""

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import kmock
import pytest
import pytest_asyncio
from kvpolicy_dev.devcluster import ThreadedDevCluster

WIDGETS_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "gadgets.http.example.dev"},
    "spec": {
        "group": "http.example.dev",
        "scope": "Namespaced",
        "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget", "shortNames": ["gdg"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
            "additionalPrinterColumns": [{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}],
        }],
    },
}  # fmt: skip


@pytest_asyncio.fixture(loop_scope="function")  # the tests' own loop; the cluster runs on its own thread
async def http(devcluster: ThreadedDevCluster) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=devcluster.url) as session:
        yield session


def configmap(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}


async def test_create_is_201_and_errors_are_status_objects(
    http: aiohttp.ClientSession, devcluster_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    async with http.post(url, json=configmap("a")) as response:
        assert response.status == 201
        assert (await response.json())["metadata"]["resourceVersion"]
    async with http.post(url, json=configmap("a")) as response:
        assert response.status == 409
        assert (await response.json())["reason"] == "AlreadyExists"
    async with http.get(f"{url}/missing") as response:
        body = await response.json()
        assert (response.status, body["kind"], body["reason"], body["code"]) == (404, "Status", "NotFound", 404)
        assert body["message"] == 'configmaps "missing" not found'
    async with http.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400
    async with http.post(url, data=b"\x0a\x00", headers={"Content-Type": "application/vnd.kubernetes.protobuf"}) as r:
        assert r.status == 415 and "protobuf" in (await r.json())["message"]


async def test_namespaces_list_and_get(http: aiohttp.ClientSession, devcluster_namespace: str) -> None:
    async with http.get("/api/v1/namespaces") as response:
        names = [item["metadata"]["name"] for item in (await response.json())["items"]]
    assert {"default", devcluster_namespace} <= set(names)
    async with http.get(f"/api/v1/namespaces/{devcluster_namespace}") as response:
        assert (await response.json())["status"]["phase"] == "Active"


async def test_list_filters_by_label_and_field_selectors(
    http: aiohttp.ClientSession, devcluster_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    for name, track in (("a", "stable"), ("b", "canary"), ("c", "shadow")):
        async with http.post(url, json=configmap(name, track=track)):
            pass
    queries = {
        "labelSelector=track in (canary,shadow)": ["b", "c"],
        "labelSelector=track notin (canary),track": ["a", "c"],
        "labelSelector=!track": [],
        "fieldSelector=metadata.name=b": ["b"],
    }
    for query, expected in queries.items():
        async with http.get(f"{url}?{query}") as response:
            assert [item["metadata"]["name"] for item in (await response.json())["items"]] == expected, query
    async with http.get(f"{url}?labelSelector=track in (a") as response:
        assert response.status == 400


async def read_events(response: aiohttp.ClientResponse, count: int) -> list[tuple[str, str]]:
    events = []
    async with asyncio.timeout(10):
        while len(events) < count:
            event = json.loads(await response.content.readline())
            events.append((event["type"], event["object"]["metadata"].get("name", event["object"].get("reason"))))
    return events


async def test_watch_resumes_from_a_resource_version_without_losing_events(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    async with http.get(url) as response:
        listed_at = (await response.json())["metadata"]["resourceVersion"]
    # Written after the list but before the watch starts: a watch from `listed_at` must still see them.
    for name in ("w1", "w2"):
        devcluster.create({**configmap(name), "metadata": {"name": name, "namespace": devcluster_namespace}})
    async with http.get(f"{url}?watch=true&resourceVersion={listed_at}") as response:
        devcluster.patch("v1", "ConfigMap", "w1", {"data": {"k": "2"}}, devcluster_namespace)
        devcluster.delete("v1", "ConfigMap", "w2", devcluster_namespace)
        assert await read_events(response, 4) == [("ADDED", "w1"), ("ADDED", "w2"), ("MODIFIED", "w1"),
                                                  ("DELETED", "w2")]  # fmt: skip


async def test_watch_without_version_starts_with_the_current_objects_and_honours_timeout(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    devcluster.create({**configmap("existing"), "metadata": {"name": "existing", "namespace": devcluster_namespace}})
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps?watch=true&timeoutSeconds=1"
    async with http.get(url) as response:
        lines = (await response.text()).splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["ADDED"]


async def test_selector_watch_sees_objects_entering_and_leaving(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    devcluster.create({**configmap("x"), "metadata": {"name": "x", "namespace": ns, "labels": {"role": "other"}}})
    async with http.get(f"/api/v1/namespaces/{ns}/configmaps?watch=true&labelSelector=role=canary") as response:
        devcluster.patch("v1", "ConfigMap", "x", {"metadata": {"labels": {"role": "canary"}}}, ns)
        devcluster.patch("v1", "ConfigMap", "x", {"metadata": {"labels": {"role": "stable"}}}, ns)
        assert await read_events(response, 2) == [("ADDED", "x"), ("DELETED", "x")]


async def test_watch_from_an_expired_version_reports_410(http: aiohttp.ClientSession, devcluster_namespace: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr("kvpolicy_dev.devcluster.store.EVENT_LOG_LIMIT", 1)
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    for name in ("e1", "e2"):
        async with http.post(url, json=configmap(name)):
            pass
    async with http.get(f"{url}?watch=true&resourceVersion=1") as response:
        event = json.loads(await response.content.readline())
    assert (event["type"], event["object"]["code"], event["object"]["reason"]) == ("ERROR", 410, "Expired")


async def test_watch_bookmarks_carry_the_latest_version_when_nothing_matches(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    devcluster.call(setattr, devcluster.cluster.api, "bookmark_seconds", 0.2)
    try:
        url = f"/api/v1/namespaces/{ns}/configmaps"
        async with http.get(f"{url}?labelSelector=role=none") as response:
            listed_at = (await response.json())["metadata"]["resourceVersion"]
        # Python clients send booleans as True; kube-apiserver reads flags with Go's strconv.ParseBool.
        query = f"watch=True&allowWatchBookmarks=True&labelSelector=role=none&resourceVersion={listed_at}"
        async with http.get(f"{url}?{query}") as response:
            devcluster.create({**configmap("unrelated"), "metadata": {"name": "unrelated", "namespace": ns}})
            latest = devcluster.call(lambda: devcluster.cluster.api.store.resource_version)
            event = json.loads(await asyncio.wait_for(response.content.readline(), 5))
    finally:
        devcluster.call(setattr, devcluster.cluster.api, "bookmark_seconds", 1.0)
    assert event["type"] == "BOOKMARK" and event["object"]["kind"] == "ConfigMap"
    assert int(event["object"]["metadata"]["resourceVersion"]) >= latest > int(listed_at)


async def test_without_an_accepted_bearer_token_every_request_is_401(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    devcluster.accept_tokens(frozenset({"good"}))
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    for headers in ({}, {"Authorization": "Bearer bad"}, {"Authorization": "Basic Z29vZA=="}):
        async with http.get(url, headers=headers) as response:
            body = await response.json()
            assert (response.status, body["kind"], body["reason"], body["code"]) == (401, "Status", "Unauthorized", 401)
    async with http.get(url, headers={"Authorization": "Bearer good"}) as response:
        assert response.status == 200
    devcluster.accept_tokens(None)
    async with http.get(url) as response:
        assert response.status == 200


async def test_injected_faults_fail_exactly_the_matching_requests(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    fault = devcluster.fail_next(2, 503, method="POST", resource="configmaps")
    statuses = []
    for name in ("f1", "f2", "f3"):
        async with http.post(url, json=configmap(name)) as response:
            statuses.append(response.status)
            if response.status == 503:
                assert (await response.json())["reason"] == "ServiceUnavailable"
    assert statuses == [503, 503, 201] and fault.hits == 2
    devcluster.fail_next(1, 409, method="PATCH", name="f3")
    patch = {"headers": {"Content-Type": "application/merge-patch+json"}, "data": json.dumps({"data": {"k": "2"}})}
    async with http.get(f"{url}/f3") as response:
        assert response.status == 200  # a GET does not match a PATCH fault
    async with http.patch(f"{url}/f3", **patch) as response:
        assert response.status == 409
    async with http.patch(f"{url}/f3", **patch) as response:
        assert response.status == 200


async def test_kmock_reactions_take_precedence(http: aiohttp.ClientSession, devcluster: ThreadedDevCluster) -> None:
    api = devcluster.cluster.api
    reaction = api["get", kmock.resource("", "v1", "nodes")] << {"kind": "NodeList", "items": ["overridden"]}
    try:
        async with http.get("/api/v1/nodes") as response:
            assert (await response.json())["items"] == ["overridden"]
    finally:
        api._payloads.remove(reaction)
    async with http.get("/api/v1/nodes") as response:
        assert (await response.json())["items"][0]["kind"] == "Node"


async def test_crd_applied_at_runtime_is_discoverable_and_printed_as_table(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    devcluster.apply(WIDGETS_CRD)
    async with http.get("/apis") as response:
        groups = {group["name"]: group for group in (await response.json())["groups"]}
    assert groups["http.example.dev"]["preferredVersion"]["version"] == "v1"
    async with http.get("/apis/http.example.dev") as response:
        assert (await response.json())["kind"] == "APIGroup"
    async with http.get("/apis/http.example.dev/v1") as response:
        resources = {r["name"]: r for r in (await response.json())["resources"]}
    assert resources["gadgets"]["shortNames"] == ["gdg"] and resources["gadgets"]["kind"] == "Gadget"
    assert "gadgets/status" in resources
    url = f"/apis/http.example.dev/v1/namespaces/{devcluster_namespace}/gadgets"
    async with http.post(url, json={"apiVersion": "http.example.dev/v1", "kind": "Gadget", "metadata": {"name": "g"}}):
        pass
    status_patch = {"headers": {"Content-Type": "application/merge-patch+json"},
                    "data": json.dumps({"status": {"phase": "Canary"}})}  # fmt: skip
    async with http.patch(f"{url}/g/status", **status_patch) as response:
        assert (await response.json())["status"] == {"phase": "Canary"}
    table_accept = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}
    async with http.get(url, headers=table_accept) as response:
        table = await response.json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Phase"]
    assert table["rows"][0]["cells"] == ["g", "Canary"]
    async with http.get(f"{url}/g", headers=table_accept) as response:
        assert (await response.json())["rows"][0]["cells"][0] == "g"
    devcluster.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", "gadgets.http.example.dev")
    async with http.get(url) as response:
        assert response.status == 404


async def test_events_and_leases(http: aiohttp.ClientSession, devcluster_namespace: str) -> None:
    ns = devcluster_namespace
    event = {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"generateName": "canary."},
             "reason": "Promoted", "note": "FP8 passed the gates", "type": "Normal", "action": "Promote",
             "regarding": {"kind": "KVPolicy", "name": "llama", "namespace": ns}}  # fmt: skip
    async with http.post(f"/apis/events.k8s.io/v1/namespaces/{ns}/events", json=event) as response:
        assert response.status == 201 and (await response.json())["metadata"]["name"].startswith("canary.")
    lease_url = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "leader"},
             "spec": {"holderIdentity": "a"}}  # fmt: skip
    async with http.post(lease_url, json=lease) as response:
        created = await response.json()
    takeover = {**created, "spec": {"holderIdentity": "b"}}
    async with http.put(f"{lease_url}/leader", json=takeover) as response:
        assert response.status == 200
    async with http.put(f"{lease_url}/leader", json={**created, "spec": {"holderIdentity": "c"}}) as response:
        assert response.status == 409  # a stale resourceVersion loses the race
    async with http.get(f"{lease_url}/leader") as response:
        assert (await response.json())["spec"]["holderIdentity"] == "b"


async def test_an_outage_fails_every_request_ends_watches_and_ends_when_lifted(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    async with http.get("/readyz") as response:
        assert (response.status, await response.text()) == (200, "ok")
    async with http.get(f"{url}?watch=true") as watch:
        fault = devcluster.outage(503)
        try:
            async with asyncio.timeout(5):
                assert await watch.content.read() == b"", "the open watch ends"
            for path in ("/readyz", url, "/apis"):
                async with http.get(path) as response:
                    assert response.status == 503
            async with http.post(url, json=configmap("during")) as response:
                assert (await response.json())["message"].startswith("the API server is unavailable")
        finally:
            devcluster.end_fault(fault)
    async with http.post(url, json=configmap("after")) as response:
        assert response.status == 201


async def test_faults_for_one_client_and_the_write_log(
    http: aiohttp.ClientSession, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    url = f"/api/v1/namespaces/{devcluster_namespace}/configmaps"
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    started = len(devcluster.writes())
    fault = devcluster.outage(503, user="alice", method="POST")
    try:
        async with http.post(url, json=configmap("a"), headers=alice) as response:
            assert response.status == 503
        async with http.get(url, headers=alice) as response:
            assert response.status == 200, "only alice's writes are cut off"
        async with http.post(url, json=configmap("b"), headers=bob) as response:
            assert response.status == 201
    finally:
        devcluster.end_fault(fault)
    async with http.delete(f"{url}/b") as response:
        assert response.status == 200
    log = [(w.user, w.method, w.resource, w.path.name if w.path else None, w.code) for w in devcluster.writes()]
    assert log[started:] == [
        ("alice", "POST", "configmaps", None, 503),
        ("bob", "POST", "configmaps", None, 201),
        (None, "DELETE", "configmaps", "b", 200),
    ]
