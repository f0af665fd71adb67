"""What the operator cannot do, said and survived on the emulated cluster: a write the API server refuses, a target
another policy governs, an invalid stored policy (which must still be deletable)."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from typing import Any

from e2e_helpers import (
    KVP,
    OperatorFactory,
    event_reasons,
    policy,
    start_and_reach_the_gate,
    target,
    wait_decided,
    wait_phase,
    wait_until,
)
from kvpolicy.api import crd
from kvpolicy.notify import metrics
from kvpolicy.rollout import builders as b
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster

Obj = dict[str, object]


def _ready(cluster: ThreadedDevCluster, namespace: str, name: str) -> Obj | None:
    found = cluster.find(*KVP, name, namespace) or {}
    conditions = (found.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), None)


@contextlib.contextmanager
def _schema_without_rules(cluster: ThreadedDevCluster) -> Iterator[None]:
    """The KVPolicy CRD of an older release, without CEL rules: what it admitted stays stored once the current CRD
    is back (an API server does not validate stored objects again)."""
    current = crd.crd_object()
    older = copy.deepcopy(current)

    def drop_rules(node: Any) -> None:
        if isinstance(node, dict):
            node.pop("x-kubernetes-validations", None)
        for value in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            drop_rules(value)

    drop_rules(older["spec"]["versions"])
    cluster.apply(older)
    try:
        yield
    finally:
        cluster.apply(current)


def _errors(kind: str) -> float:
    return metrics.OPERATOR_METRICS.registry.get_sample_value("kvpolicy_reconcile_errors_total", {"kind": kind}) or 0


def _children(cluster: ThreadedDevCluster, namespace: str, name: str) -> list[Obj]:
    selector = f"{b.POLICY_LABEL}={b.policy_labels(name)[b.POLICY_LABEL]}"
    kinds = (("apps/v1", "Deployment"), ("v1", "Service"), ("batch/v1", "Job"))
    return [obj for api_version, kind in kinds for obj in cluster.list(api_version, kind, namespace, selector)]


def test_a_refused_write_is_said_counted_and_the_deadline_still_frees_the_gpu(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    ns = devcluster_namespace
    devcluster.set_pool_capacity("h200", 1)  # the target's pod takes the only GPU: the canary stays Pending
    devcluster.create(target(ns))
    refusals = devcluster.fail_next(10_000, 422, method="POST", resource="services", namespace=ns)
    before = _errors("Invalid")
    with operator():
        devcluster.create(policy(ns, **{"rollout.progressDeadlineSeconds": 4}))
        wait_until(lambda: (_ready(devcluster, ns, "llama-fp8") or {}).get("status") == "False", "Ready=False")
        ready = _ready(devcluster, ns, "llama-fp8")
        assert ready is not None and ready["reason"] == "APIRequestRejected"
        assert "the API server refused to create Service llama-fp8-canary-g1: 422 Invalid" in ready["message"]
        done = wait_decided(devcluster, ns)
    assert refusals.hits >= 2
    status = done["status"]
    assert (status["phase"], status["decision"]["reason"]) == ("RolledBack", "CapacityUnavailable"), status
    assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == [], "no GPU held"
    assert event_reasons(devcluster, ns).count("APIRequestRejected") == 1, "said once, not once per pass"
    assert _errors("Invalid") >= before + refusals.hits, "every refusal counted"


def test_a_second_policy_on_the_same_target_waits_for_the_first_to_be_deleted(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, fixed_image_runner: None
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        start_and_reach_the_gate(devcluster, ns)
        devcluster.create(policy(ns, name="llama-bf16", **{"kvCache.dtype": "BF16"}))
        wait_until(lambda: (_ready(devcluster, ns, "llama-bf16") or {}).get("reason") == "Conflict", "Conflict")
        ready = _ready(devcluster, ns, "llama-bf16")
        assert ready is not None and "governed by KVPolicy llama-fp8" in ready["message"]
        time.sleep(1.0)  # several of the second policy's passes
        assert _children(devcluster, ns, "llama-bf16") == [], "no canary, no Service, no Job"
        assert event_reasons(devcluster, ns, "llama-bf16") == ["Conflict"]
        assert devcluster.get(*KVP, "llama-bf16", ns)["status"]["phase"] == "Planning"
        devcluster.delete(*KVP, "llama-fp8", ns)
        done = wait_phase(devcluster, ns, {"HeldBF16"}, name="llama-bf16")
    assert done["status"]["decision"]["reason"] == "BF16Requested"
    assert _ready(devcluster, ns, "llama-bf16")["status"] == "True"  # type: ignore[index]


def test_an_invalid_stored_policy_is_said_once_counted_and_can_be_deleted(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    devcluster.set_runner(SimulatorRunner(time_scale=0.001))
    ns = devcluster_namespace
    devcluster.create(target(ns))
    before = _errors("InvalidSpec")
    with operator():
        start_and_reach_the_gate(devcluster, ns)
        assert _children(devcluster, ns, "llama-fp8")
        # As after an upgrade that tightened the schema: the stored object no longer validates.
        with _schema_without_rules(devcluster):
            devcluster.patch(*KVP, "llama-fp8", {"spec": {"gates": {"accuracy": {"minRecovery": "1.5"}}}}, ns)
        wait_until(lambda: (_ready(devcluster, ns, "llama-fp8") or {}).get("reason") == "InvalidSpec", "InvalidSpec")
        ready = _ready(devcluster, ns, "llama-fp8")
        assert ready is not None and "spec.gates.accuracy: gates.accuracy.minRecovery must be" in ready["message"]
        idle = 5.0  # KVPOLICY_IDLE_SECONDS of the tests' operator
        time.sleep(idle + 1.0)
        assert event_reasons(devcluster, ns).count("InvalidSpec") == 1, "not re-posted every idle period"
        assert _errors("InvalidSpec") >= before + 2, "counted every pass, so the reconcile-error alert fires"
        devcluster.delete(*KVP, "llama-fp8", ns)
        devcluster.wait_deleted(*KVP, "llama-fp8", ns, give_up_after=30)
    assert _children(devcluster, ns, "llama-fp8") == []


def test_a_policy_near_the_annotation_limit_is_handled_and_deleted(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory
) -> None:
    """kopf keeps its last-handled configuration in an annotation by default: a full copy of a 200 KiB annotation
    would pass the API server's 256 KiB limit, and every later patch (the finalizer's removal too) would be refused.
    The operator stores none (handlers.NoDiffBaseStorage): only the finalizer is written to the policy."""
    ns = devcluster_namespace
    devcluster.create(target(ns))
    large = policy(ns)
    large["metadata"]["annotations"] = {"example.com/runbook": "x" * 200 * 1024}
    with operator() as runner:
        devcluster.create(large)
        wait_until(lambda: (devcluster.get(*KVP, "llama-fp8", ns).get("status") or {}).get("phase"), "a phase")

        def held() -> bool:
            return devcluster.get(*KVP, "llama-fp8", ns)["metadata"].get("finalizers") == ["kvpolicy.dev/finalizer"]

        wait_until(held, "the finalizer")
        stored = devcluster.get(*KVP, "llama-fp8", ns)["metadata"]
        assert [key for key in stored["annotations"] if key.startswith("kvpolicy.dev/")] == []
        devcluster.delete(*KVP, "llama-fp8", ns)
        devcluster.wait_deleted(*KVP, "llama-fp8", ns, give_up_after=30)
    assert "Traceback" not in runner.output
