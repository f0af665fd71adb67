"""A LeaderWorkerSet target through the observer, the executor and the cleanup: read and written as the custom
resource it is, its leaders (not its workers) taken as the baseline."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fake_kube import FakeKubeApi
from kvpolicy.api.v1alpha1 import KVPolicy
from kvpolicy.kube.api import KVPOLICIES, NODES, PODS, Resource
from kvpolicy.kube.observe import Observer
from kvpolicy.planning.gpu import KNOWN_PRODUCTS
from kvpolicy.rollout import builders as b
from kvpolicy.runtime.reconciler import Reconciler
from operator_helpers import CONFIG, NAMESPACE, policy_spec, target_leaderworkerset

NOW = datetime(2026, 1, 1, tzinfo=UTC)
LEADERWORKERSETS = Resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
LWS_REF = {"targetRef.kind": "LeaderWorkerSet", "targetRef.apiVersion": "leaderworkerset.x-k8s.io/v1"}


def raw_policy() -> dict[str, Any]:
    return {
        "apiVersion": "kvpolicy.dev/v1alpha1",
        "kind": "KVPolicy",
        "metadata": {"name": "llama-fp8", "namespace": NAMESPACE, "uid": "uid-1", "generation": 1},
        "spec": policy_spec(**LWS_REF),
    }


def pod(name: str, worker_index: str, ready: bool = True) -> dict[str, Any]:
    labels = {"leaderworkerset.sigs.k8s.io/name": "llama", "leaderworkerset.sigs.k8s.io/worker-index": worker_index}
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": name, "labels": labels}, "status": {"podIP": "10.0.0.1", "conditions": [condition]}}


async def test_a_leaderworkerset_policy_gets_a_canary_leaderworkerset_and_a_baseline_of_the_leaders() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy())
    api.put(LEADERWORKERSETS, NAMESPACE, target_leaderworkerset())
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["H200"], "pool": "h200"}}})
    for name, index in (("llama-0", "0"), ("llama-0-1", "1"), ("llama-1", "0"), ("llama-1-1", "1")):
        api.put(PODS, NAMESPACE, pod(name, index))
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    await reconciler.reconcile_once(NAMESPACE, "llama-fp8")
    stored = api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]
    assert stored["status"]["phase"] == "CanaryStarting", stored["status"]
    canary = api.objects[("leaderworkersets", NAMESPACE, "llama-fp8-canary-g1")]
    assert canary["kind"] == "LeaderWorkerSet"
    assert not [key for key in api.objects if key[0] == "deployments"]
    policy = KVPolicy.model_validate(stored)
    target = api.objects[("leaderworkersets", NAMESPACE, "llama")]
    baseline = await Observer(api)._baseline(policy, target)
    assert sorted(view.name for view in baseline) == ["llama-0", "llama-1"], "the leaders serve; workers do not"
    summary = await reconciler.cleanup(stored)
    assert ("leaderworkersets", NAMESPACE, "llama-fp8-canary-g1") not in api.objects
    assert ("leaderworkersets", NAMESPACE, "llama") in api.objects
    assert summary == "llama left as it runs: BF16 KV cache, image vllm:0.12"
    assert b.POLICY_LABEL in canary["metadata"]["labels"]
