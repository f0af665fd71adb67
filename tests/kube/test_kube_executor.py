"""The executor, the observer and the per-policy reconciler against an in-memory API."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from fake_kube import FakeKubeApi
from kvpolicy.kube.api import DEPLOYMENTS, JOBS, KVPOLICIES, NODES, PODS, ApiError
from kvpolicy.kube.executor import (
    StaleObservationError,
    apply_actions,
    event_body,
    merge_patch,
    post_events,
    write_status,
)
from kvpolicy.kube.observe import Observer, gpu_node_selector, job_view, pod_view
from kvpolicy.notify import metrics
from kvpolicy.planning.gpu import KNOWN_PRODUCTS
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.rules import rollout_hash
from kvpolicy.rollout.step_types import Create, Delete, Event, Kind, Patch
from kvpolicy.runtime.reconciler import Reconciler
from operator_helpers import CONFIG, NAMESPACE, make_policy, policy_spec, target_deployment

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class NeverStopped:
    """A daemon stop flag that is never set."""

    def __bool__(self) -> bool:
        return False

    async def wait(self) -> None:
        await asyncio.Event().wait()


def raw_policy(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpolicy.dev/v1alpha1",
        "kind": "KVPolicy",
        "metadata": {"name": "llama-fp8", "namespace": NAMESPACE, "uid": "uid-1", "generation": 1},
        "spec": policy_spec(**spec),
    }


def test_merge_patch_nulls_removed_keys_and_replaces_lists() -> None:
    old = {"phase": "A", "latency": {"probe": {"verdict": "Running"}, "checks": 1}, "conditions": [1, 2], "gone": 1}
    new = {"phase": "B", "latency": {"checks": 1}, "conditions": [2]}
    assert merge_patch(old, new) == {"gone": None, "phase": "B", "latency": {"probe": None}, "conditions": [2]}
    assert merge_patch(new, new) == {}


async def test_apply_actions_tolerates_existing_and_missing_objects() -> None:
    api = FakeKubeApi()
    body = {"metadata": {"name": "x"}}
    await apply_actions(api, NAMESPACE, [Create(Kind.JOB, body), Create(Kind.JOB, body), Delete(Kind.SERVICE, "nope")])
    assert api.objects[("jobs", NAMESPACE, "x")] == body


async def test_a_stale_json_patch_asks_for_a_fresh_observation() -> None:
    api = FakeKubeApi()
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    patch = [{"op": "test", "path": "/spec/template/spec/containers/0/name", "value": "other"}]
    with pytest.raises(StaleObservationError) as caught:
        await apply_actions(api, NAMESPACE, [Patch(Kind.DEPLOYMENT, "llama", patch, "json")])
    assert caught.value.retryable


async def test_write_status_sends_only_changes_and_never_kopf_state() -> None:
    api = FakeKubeApi()
    raw = {**raw_policy(), "status": {"phase": "Planning", "kopf": {"progress": {}}}}
    api.put(KVPOLICIES, NAMESPACE, raw)
    await write_status(api, raw, {"phase": "Planning"})
    assert api.calls == []
    await write_status(api, raw, {"phase": "CanaryStarting"})
    assert api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]["status"]["kopf"] == {"progress": {}}


async def test_events_are_best_effort() -> None:
    api = FakeKubeApi(fail={"event": ApiError(500, "InternalError", "down")})
    events = [Event("Warning", "First", "lost"), Event("Normal", "Second", "kept")]
    await post_events(api, raw_policy(), events, NOW)
    assert [e["reason"] for e in api.events] == ["Second"]
    body = event_body(raw_policy(), Event("Normal", "Planned", "m"), NOW)
    assert body["involvedObject"]["uid"] == "uid-1" and body["source"]["component"] == "kvpolicy-operator"


def test_pod_and_job_views() -> None:
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no GPU"}
    pending = {"metadata": {"name": "p", "labels": {"a": "b"}}, "status": {"conditions": [scheduled]}}
    assert pod_view(pending).unschedulable == "no GPU" and not pod_view(pending).ready
    job = {"metadata": {"name": "j"}, "status": {"conditions": [{"type": "Failed", "status": "True",
                                                                 "reason": "DeadlineExceeded"}]}}  # fmt: skip

    def pod(finished: str, message: str, code: int) -> dict[str, Any]:
        terminated = {"finishedAt": finished, "message": message, "exitCode": code}
        return {
            "metadata": {"name": finished},
            "status": {"containerStatuses": [{"state": {"terminated": terminated}}]},
        }

    view = job_view(job, [pod("2026-01-01T00:00:02Z", "second", 2), pod("2026-01-01T00:00:01Z", "first", 1)])
    assert view.failed and view.failure_reason == "DeadlineExceeded"
    assert (view.exit_code, view.termination_message) == (2, "second")


def test_gpu_node_selector_prefers_the_spec_then_the_target() -> None:
    target = target_deployment()
    assert gpu_node_selector(make_policy(), target) == {"pool": "h200"}
    assert gpu_node_selector(make_policy(**{"gpuNodeSelector": {"x": "y"}}), target) == {"x": "y"}
    del target["spec"]["template"]["spec"]["nodeSelector"]
    assert gpu_node_selector(make_policy(), target) == {"nvidia.com/gpu.present": "true"}


async def test_observer_reads_gpu_facts_while_planning_and_only_the_target_once_decided() -> None:
    api = FakeKubeApi()
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["B200"], "pool": "h200"}}})
    observed = await Observer(api).observe(make_policy(), NOW)
    assert observed.gpu is not None and observed.gpu.generation.value == "Blackwell"
    spec_hash = rollout_hash(make_policy().spec)
    promoted = make_policy(status={"phase": "Promoted", "specHash": spec_hash})
    api.calls.clear()
    assert (await Observer(api).observe(promoted, NOW)).target is not None, "drift needs the target"
    assert sorted(api.calls) == ["get deployments", "list kvpolicies"], "the target, and which policy governs it"
    rolled_back = make_policy(status={"phase": "RolledBack", "specHash": spec_hash})
    api.calls.clear()
    assert (await Observer(api).observe(rolled_back, NOW)).target is None
    assert api.calls == ["list kvpolicies"], "only which policy governs the target"


async def test_reconciler_takes_a_policy_from_planning_to_its_canary() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy())
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["H200"], "pool": "h200"}}})
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    delay = await reconciler.reconcile_once(NAMESPACE, "llama-fp8")
    assert delay == CONFIG.poll_seconds
    stored = api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]
    assert stored["status"]["phase"] == "CanaryStarting"
    assert ("deployments", NAMESPACE, "llama-fp8-canary-g1") in api.objects
    assert "Planned" in [event["reason"] for event in api.events]
    registry = metrics.OPERATOR_METRICS.registry
    assert registry.get_sample_value("kvpolicy_policies", {"phase": "CanaryStarting"}) >= 1
    labels = {"namespace": NAMESPACE, "policy": "llama-fp8", "phase": "CanaryStarting"}
    deadline = NOW.timestamp() + 600  # the helper's progressDeadlineSeconds
    assert registry.get_sample_value("kvpolicy_policy_phase_deadline_timestamp_seconds", labels) == deadline
    api.put(PODS, NAMESPACE, {"metadata": {"name": "c", "labels": {b.POLICY_LABEL: "llama-fp8"}}})
    api.calls.clear()
    assert await reconciler.reconcile_once(NAMESPACE, "llama-fp8", "uid-1") == CONFIG.poll_seconds
    assert "get kvpolicies" not in api.calls, "the object its own status write returned is fresh enough"
    reconciler.notice("uid-1", generation=2, deleting=False)
    await reconciler.reconcile_once(NAMESPACE, "llama-fp8", "uid-1")
    assert "get kvpolicies" in api.calls, "a new generation is read from the API"
    assert ("jobs", NAMESPACE, "llama-fp8-accuracy-g1") not in api.objects, "no ready canary pod yet"
    assert not [key for key in api.objects if key[0] == JOBS.plural]


async def test_a_policy_at_rest_is_not_kept_in_memory_between_its_passes() -> None:
    """Thousands of decided policies are looked at once per idle period: each is read again then, not kept whole."""
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy(**{"workload.typicalContextTokens": 2048}))
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["H200"], "pool": "h200"}}})
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    assert await reconciler.reconcile_once(NAMESPACE, "llama-fp8", "uid-1") == CONFIG.idle_seconds
    assert api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]["status"]["phase"] == "HeldBF16"
    assert reconciler._known == {}
    api.calls.clear()
    await reconciler.reconcile_once(NAMESPACE, "llama-fp8", "uid-1")
    assert "get kvpolicies" in api.calls


class _NeverStopped:
    def __bool__(self) -> bool:
        return False

    async def wait(self) -> None:
        await asyncio.Event().wait()


async def test_a_waiting_policy_deleted_before_the_one_it_waited_for_leaves_nothing_behind() -> None:
    """Waiting policies are remembered per policy they wait for, to be woken when it goes; one that goes first is
    forgotten (thousands created and deleted while another governs their target must not pile up)."""
    api = FakeKubeApi()
    first = raw_policy()
    first["metadata"].update(uid="uid-0", creationTimestamp="2026-01-01T00:00:00Z")
    first["metadata"]["name"] = "first"
    api.put(KVPOLICIES, NAMESPACE, first)
    second = raw_policy()
    second["metadata"]["creationTimestamp"] = "2026-01-02T00:00:00Z"
    api.put(KVPOLICIES, NAMESPACE, second)
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    await reconciler.reconcile_once(NAMESPACE, "llama-fp8", "uid-1")
    assert reconciler._waiting == {(NAMESPACE, "first"): {"uid-1"}}
    del api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]
    await reconciler.run_policy(NAMESPACE, "llama-fp8", "uid-1", _NeverStopped())
    assert reconciler._waiting == {}


def _ready(api: FakeKubeApi) -> tuple[str, str, str]:
    stored = api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]
    ready = next(c for c in stored["status"]["conditions"] if c["type"] == "Ready")
    return ready["status"], ready["reason"], ready["message"]


def _errors(kind: str) -> float:
    return metrics.OPERATOR_METRICS.registry.get_sample_value("kvpolicy_reconcile_errors_total", {"kind": kind}) or 0


async def test_an_invalid_spec_is_a_condition_counted_every_pass_with_one_event_per_change() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy(**{"gates.accuracy.minRecovery": "2"}))
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    before = _errors("InvalidSpec")
    for _ in range(3):
        assert await reconciler.reconcile_once(NAMESPACE, "llama-fp8") == CONFIG.idle_seconds
    status, reason, message = _ready(api)
    assert (status, reason) == ("False", "InvalidSpec")
    rule = 'gates.accuracy.minRecovery must be a number in (0, 1], such as "0.95" (got "2")'
    assert message == f"invalid KVPolicy: spec.gates.accuracy: {rule}"
    assert _errors("InvalidSpec") == before + 3, "the alert on reconcile errors sees every pass"
    assert [event["reason"] for event in api.events] == ["InvalidSpec"], "the event is not re-posted each idle period"
    key = ("kvpolicies", NAMESPACE, "llama-fp8")
    api.objects[key]["spec"]["targetRef"]["kind"] = "StatefulSet"
    await reconciler.reconcile_once(NAMESPACE, "llama-fp8")
    assert len(api.events) == 2 and "spec.targetRef.kind" in _ready(api)[2], "a different problem is news"
    api.objects[key]["spec"] = policy_spec()
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["H200"], "pool": "h200"}}})
    await reconciler.reconcile_once(NAMESPACE, "llama-fp8")
    assert _ready(api)[:2] == ("True", "Reconciled")
    assert api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]["status"]["phase"] == "CanaryStarting"


async def test_a_refused_write_is_a_condition_an_event_and_a_metric_and_the_other_writes_go_on() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy())
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["H200"], "pool": "h200"}}})
    api.fail["create"] = ApiError(422, "Invalid", 'Deployment.apps "x" is invalid: metadata.name: Invalid value')
    before = _errors("Invalid")
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    assert await reconciler.reconcile_once(NAMESPACE, "llama-fp8") == CONFIG.poll_seconds
    assert ("deployments", NAMESPACE, "llama-fp8-canary-g1") not in api.objects
    assert ("services", NAMESPACE, "llama-fp8-canary-g1") in api.objects, "the other creates were made"
    status, reason, message = _ready(api)
    assert (status, reason) == ("False", "APIRequestRejected")
    assert message.startswith("the API server refused to create Deployment llama-fp8-canary-g1: 422 Invalid")
    assert api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]["status"]["phase"] == "CanaryStarting", "written"
    assert _errors("Invalid") == before + 1
    # Said once; the plan's own Warning (the patched image is not the target's) is the only other.
    warnings = [e["reason"] for e in api.events if e["type"] == "Warning"]
    assert sorted(warnings) == ["APIRequestRejected", "CanaryImageDiffers"]
    await reconciler.reconcile_once(NAMESPACE, "llama-fp8", "uid-1")
    assert _ready(api)[:2] == ("True", "Reconciled"), "the create went through this time"


class StopAfter:
    """A loop's stop flag that is set after `passes` passes (the loop looks at it before each)."""

    def __init__(self, passes: int) -> None:
        self.passes = passes

    def __bool__(self) -> bool:
        self.passes -= 1
        return self.passes < 0


async def test_a_refused_read_of_the_policy_is_logged_counted_and_said_once_and_the_loop_goes_on() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy())
    forbidden = ApiError(403, "Forbidden", 'kvpolicies.kvpolicy.dev "llama-fp8" is forbidden')
    reconciler = Reconciler(api, CONFIG, max_backoff_seconds=0.01)
    original_get = api.get

    async def refuse(*args: Any) -> Any:
        api.calls.append("get kvpolicies")
        raise forbidden

    api.get = refuse  # type: ignore[method-assign]
    before = _errors("Forbidden")
    await asyncio.wait_for(reconciler.run_policy(NAMESPACE, "llama-fp8", "uid-1", StopAfter(3)), timeout=5)
    assert api.calls.count("get kvpolicies") == 3 and _errors("Forbidden") == before + 3
    assert [event["reason"] for event in api.events] == ["APIRequestRejected"]
    assert api.events[0]["involvedObject"]["uid"] == "uid-1"
    api.get = original_get  # type: ignore[method-assign]


async def test_reconciler_retries_retryable_errors_and_stops_when_the_policy_is_gone() -> None:
    api = FakeKubeApi(fail={"get": ApiError(503, "ServiceUnavailable", "busy")})
    reconciler = Reconciler(api, CONFIG, max_backoff_seconds=0.01)

    await asyncio.wait_for(reconciler.run_policy(NAMESPACE, "llama-fp8", "uid-1", NeverStopped()), timeout=5)
    assert api.calls == ["get kvpolicies", "get kvpolicies"], "one failure, then the policy was found gone"


async def test_reconciler_survives_an_unexpected_error() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy())
    api.fail["get"] = RuntimeError("a bug")
    reconciler = Reconciler(api, CONFIG, max_backoff_seconds=0.01)
    del api.objects[("kvpolicies", NAMESPACE, "llama-fp8")]

    await asyncio.wait_for(reconciler.run_policy(NAMESPACE, "llama-fp8", "uid-1", NeverStopped()), timeout=5)
    assert api.calls == ["get kvpolicies", "get kvpolicies"]


async def test_observer_ignores_a_canary_being_deleted() -> None:
    api = FakeKubeApi()
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    canary = target_deployment()
    canary["metadata"] = {"name": "llama-fp8-canary-g1", "deletionTimestamp": "2026-01-01T00:00:00Z"}
    api.put(DEPLOYMENTS, NAMESPACE, canary)
    canary_ref = {"deployment": "llama-fp8-canary-g1", "service": "llama-fp8-canary-g1", "generation": 1}
    status = {"phase": "Promoting", "specHash": rollout_hash(make_policy().spec), "canary": canary_ref}
    observed = await Observer(api).observe(make_policy(status=status), NOW)
    assert observed.target is not None and observed.canary is None


async def test_an_invalid_policy_is_cleaned_up_by_its_children_labels_and_owner() -> None:
    api = FakeKubeApi()
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    raw = raw_policy()
    raw["spec"]["gates"] = {"accuracy": {"minRecovery": 0.95}}  # a float: the tightened schema refuses it
    owner = {"uid": "uid-1", "kind": "KVPolicy"}
    mine = {"name": "llama-fp8-canary-g1", "labels": b.policy_labels("llama-fp8"), "ownerReferences": [owner]}
    other = {"name": "lookalike", "labels": b.policy_labels("llama-fp8"), "ownerReferences": [{"uid": "uid-2"}]}
    api.put(DEPLOYMENTS, NAMESPACE, {"metadata": mine})
    api.put(DEPLOYMENTS, NAMESPACE, {"metadata": other})
    stated = await Reconciler(api, CONFIG).cleanup(raw)
    assert stated == "llama left as it runs: BF16 KV cache, image vllm:0.12"
    assert ("deployments", NAMESPACE, "llama-fp8-canary-g1") not in api.objects
    assert ("deployments", NAMESPACE, "lookalike") in api.objects, "only the policy's own children"
    del raw["spec"]["targetRef"]
    assert "no readable targetRef" in await Reconciler(api, CONFIG).cleanup(raw)


async def test_a_decision_is_counted_with_the_rollout_duration() -> None:
    api = FakeKubeApi()
    api.put(KVPOLICIES, NAMESPACE, raw_policy(**{"workload.typicalContextTokens": 2048}))
    api.put(DEPLOYMENTS, NAMESPACE, target_deployment())
    api.put(NODES, None, {"metadata": {"name": "n1", "labels": {**KNOWN_PRODUCTS["H200"], "pool": "h200"}}})
    registry = metrics.OPERATOR_METRICS.registry
    before = registry.get_sample_value("kvpolicy_rollout_duration_seconds_count", {"result": "HeldBF16"}) or 0
    await Reconciler(api, CONFIG, clock=lambda: NOW).reconcile_once(NAMESPACE, "llama-fp8")
    labels = {"namespace": NAMESPACE, "policy": "llama-fp8", "result": "HeldBF16", "reason": "BelowDecodeBreakEven"}
    assert registry.get_sample_value("kvpolicy_decisions_total", labels) >= 1
    assert registry.get_sample_value("kvpolicy_rollout_duration_seconds_count", {"result": "HeldBF16"}) == before + 1
