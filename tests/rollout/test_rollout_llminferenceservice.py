"""A KServe LLMInferenceService target: flags read and written in args and VLLM_ADDITIONAL_ARGS, parallel sizes from
spec.parallelism, the canary a second LLMInferenceService that joins the target's routing group at weight 1, and
leaves it at weight 0 before it is deleted."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest
from kvpolicy.api.v1alpha1 import Parallelism, TargetRef
from kvpolicy.rollout import builders as b
from kvpolicy.rollout import drift
from kvpolicy.rollout.step_types import Delete, Patch
from kvpolicy.rollout.targets.llminferenceservice import LLMInferenceServiceTarget
from operator_helpers import (
    TARGET_IMAGE,
    Driver,
    World,
    gate_output,
    make_policy,
    target_llminferenceservice,
)
from pydantic import ValidationError
from test_rollout_builders import FP8_PLAN

ISVC = LLMInferenceServiceTarget()
POLICY = b.PolicyRef(name="llama-fp8", namespace="serving", uid="uid-1")
ISVC_REF = {"targetRef.kind": "LLMInferenceService", "targetRef.apiVersion": "serving.kserve.io/v1alpha2"}
BASE = "--max-model-len 131072 --enable-prefix-caching"
FP8 = "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window"


def _additional(obj: dict[str, Any]) -> str:
    for item in obj["spec"]["template"]["containers"][0].get("env") or []:
        if item["name"] == "VLLM_ADDITIONAL_ARGS":
            return str(item["value"])
    raise AssertionError("no VLLM_ADDITIONAL_ARGS")


def test_a_targetref_names_an_llminferenceservice_only_at_its_api_version() -> None:
    TargetRef.model_validate({"kind": "LLMInferenceService", "apiVersion": "serving.kserve.io/v1alpha2", "name": "l"})
    with pytest.raises(ValidationError, match=r"\(LLMInferenceService serving.kserve.io/v1alpha1\)"):
        TargetRef.model_validate(
            {"kind": "LLMInferenceService", "apiVersion": "serving.kserve.io/v1alpha1", "name": "l"}
        )


def test_the_canary_is_a_second_llminferenceservice_outside_the_routing_group_running_the_plan() -> None:
    target = target_llminferenceservice()
    spec = make_policy(**ISVC_REF).spec
    canary = ISVC.canary(POLICY, "llama-fp8-canary-g1", target, spec, FP8_PLAN)
    assert canary["kind"] == "LLMInferenceService" and "router" not in canary["spec"], "no user traffic yet"
    assert canary["spec"]["replicas"] == spec.rollout.canary_replicas
    assert canary["spec"]["labels"][b.CANARY_LABEL] == "llama-fp8-canary-g1", "KServe puts spec.labels on its pods"
    assert _additional(canary) == f"{BASE} {FP8}"
    assert canary["spec"]["template"]["containers"][0]["image"] == "patched:1"
    assert ISVC.parallelism(canary, None) == ISVC.parallelism(target, None) == Parallelism(tensor=4)
    assert target == target_llminferenceservice()


def test_flags_in_args_or_in_vllm_additional_args_are_read_and_replaced_in_vllm_additional_args() -> None:
    target = target_llminferenceservice()
    main = target["spec"]["template"]["containers"][0]
    main["env"][0]["value"] = f"{BASE} --kv-cache-dtype fp8_e5m2"
    main["args"] = ["--attention-backend", "FLASHINFER", "-tp", "8"]
    record = ISVC.record(target, None)
    assert b.runs_fp8(record) and ISVC.parallelism(target, None) == Parallelism(tensor=8), "args win, as in vLLM"
    desired = ISVC.with_plan(record, FP8_PLAN)
    assert desired.args == ["-tp", "8"] and desired.env is not None
    assert desired.env[0]["value"] == f"{BASE} {FP8}"
    bf16 = b.without_fp8(record)
    assert not b.runs_fp8(bf16) and bf16.env is not None and bf16.env[0]["value"] == BASE


def test_promotion_writes_vllm_additional_args_and_rollback_restores_the_target_exactly() -> None:
    target = target_llminferenceservice()
    before = ISVC.record(target, None)
    promoted = jsonpatch.apply_patch(target, ISVC.patch(target, None, ISVC.with_plan(before, FP8_PLAN)))
    assert _additional(promoted) == f"{BASE} {FP8}"
    assert jsonpatch.apply_patch(promoted, ISVC.patch(promoted, None, before)) == target
    advice = drift.advice("1-abcdef", ISVC, target, None, ISVC.with_plan(before, FP8_PLAN))
    assert '"VLLM_ADDITIONAL_ARGS"' in advice.strategic_merge_patch and "--kv-cache-dtype fp8" in advice.summary


def test_the_canary_joins_the_routing_group_at_weight_1_and_traffic_waits_for_the_groups_status() -> None:
    target = target_llminferenceservice()
    canary = ISVC.canary(POLICY, "c", target, make_policy(**ISVC_REF).spec, FP8_PLAN)
    assert not ISVC.is_joined(canary, target)
    patch = ISVC.join_patch(POLICY, "c", target)
    assert patch["spec"]["router"]["route"] == {"group": "llama", "weight": 1}
    joined = {**canary, "spec": {**canary["spec"], **patch["spec"]}}
    assert ISVC.is_joined(joined, target)
    assert ISVC.traffic_confirmed("c", target) is not None, "not in status.router.group.members yet"
    members = target["status"]["router"]["group"]["members"]
    members.append({"name": "c", "weight": 1})
    assert ISVC.traffic_confirmed("c", target) is None
    members[-1]["stopped"] = True
    assert ISVC.traffic_confirmed("c", target) is not None, "a stopped member takes no traffic"
    [stop, delete] = ISVC.retire("c")
    assert isinstance(stop, Patch) and stop.patch == {
        "metadata": {"annotations": {"serving.kserve.io/stop": "true"}},
        "spec": {"router": {"route": {"weight": 0}}},
    }
    assert delete == Delete(ISVC.object_kind, "c")
    assert ISVC.serving_selector(target) == {
        "app.kubernetes.io/name": "llama",
        "app.kubernetes.io/component": "llminferenceservice-workload",
    }


def isvc_driver(**spec: Any) -> Driver:
    return Driver(make_policy(**ISVC_REF, **spec), World(target=target_llminferenceservice(), kind=ISVC))


def _group_lists(driver: Driver, name: str) -> int:
    """KServe's part: the target's status.router.group lists the canary at the weight its spec asks for now."""
    assert driver.world.target is not None
    weight = int(driver.world.deployments[name]["spec"]["router"]["route"]["weight"])
    members = driver.world.target["status"]["router"]["group"]["members"]
    members[:] = [m for m in members if m["name"] != name] + [{"name": name, "weight": weight}]
    return weight


def test_an_llminferenceservice_canary_enters_its_group_at_weight_1_and_is_stepped_up_on_the_groups_status() -> None:
    name = "llama-fp8-canary-g1"
    driver = isvc_driver(**{"rollout.routingGroup.steps": [50, 10]})
    driver.tick()
    assert f"LLMInferenceService/{name}" in driver.world.creates
    driver.world.canary_up()
    driver.tick()
    assert driver.phase == "AccuracyGate"
    driver.world.finish_job("accuracy", gate_output("Pass", recovery=1.0, canaryScore=0.9, baselineScore=0.9))
    driver.tick(10)
    canary = driver.world.deployments[name]
    assert canary["spec"]["router"]["route"] == {"group": "llama", "weight": 1}
    driver.world.canary_up()
    driver.tick(10)
    assert driver.phase == "LatencyAnalysis" and "routing group llama" in (driver.policy.status.message or "")
    weights = [_group_lists(driver, name)]
    while driver.phase == "LatencyAnalysis" and len(weights) < 5:
        driver.tick(10)
        driver.world.canary_up()  # the fake replaces a patched canary's pods; KServe does not for a weight
        latency = driver.policy.status.latency
        if driver.phase == "LatencyAnalysis":
            assert latency is not None and latency.started_at is None, "a step counts once its weight is listed"
            weights.append(_group_lists(driver, name))
            driver.tick(10)
    driver.tick(10)  # the canary observed stopped: Promoted
    # 100 for the target: 12 of 112 is 10.7 %, 100 of 200 is 50 %.
    assert weights[:3] == [1, 12, 100], weights
    assert driver.phase == "Promoted", driver.reasons()
    assert driver.reasons().count("TrafficShifted") == 2
    assert driver.world.target is not None and "--kv-cache-dtype fp8" in _additional(driver.world.target)
    assert driver.world.target["spec"]["template"]["containers"][0]["image"] != TARGET_IMAGE
    # Kept as a way back, stopped: KServe frees its GPUs and routes nothing to it.
    kept = driver.world.deployments[name]
    assert kept["metadata"]["annotations"]["serving.kserve.io/stop"] == "true"
    assert kept["spec"]["router"]["route"]["weight"] == 0
    assert driver.policy.status.retained_canary == name
    # The policy's next rollout (a new generation) deletes the kept canary before it makes its own.
    status = driver.policy.status.model_dump(by_alias=True, exclude_none=True)
    driver.policy = make_policy(generation=2, status=status, **ISVC_REF, **{"gates.accuracy.maxSamples": 20})
    driver.tick()
    assert f"{ISVC.object_kind}/{name}" in driver.world.deletes
    assert driver.policy.status.retained_canary is None
    assert driver.policy.status.canary is not None
    assert driver.policy.status.canary.parallelism == Parallelism(tensor=4)


def test_a_group_whose_other_members_have_no_weight_gives_the_canary_no_step() -> None:
    target = target_llminferenceservice()
    assert ISVC.step_weight("c", target, 10) == 12
    target["status"]["router"]["group"]["members"][0]["weight"] = 0
    assert "no weight" in str(ISVC.step_weight("c", target, 10))
    assert ISVC.step_weight("c", {**target, "spec": {}}, 10) is None, "in no group: no weight to step"


def test_an_llminferenceservice_whose_canary_fails_the_accuracy_gate_is_left_as_it_was() -> None:
    driver = isvc_driver()
    driver.tick()
    driver.world.canary_up()
    driver.tick()
    driver.world.finish_job("accuracy", gate_output("Fail", recovery=0.4, canaryScore=0.36, baselineScore=0.9))
    for _ in range(3):
        driver.tick(10)
    assert driver.phase == "RolledBack"
    assert driver.world.target == target_llminferenceservice() and driver.world.target_patches == 0
    actions = [action for result in driver.results for action in result.actions if action.kind == ISVC.object_kind]
    assert [type(action) for action in actions[-2:]] == [Patch, Delete], "weight 0, then deleted"
    assert driver.world.deployments == {}


def _main_env(pod: dict[str, Any] | None) -> str | None:
    for container in (pod or {}).get("containers") or []:
        if container.get("name") == "main":
            return next((e["value"] for e in container.get("env") or [] if e["name"] == "VLLM_ADDITIONAL_ARGS"), None)
    return None


def test_multi_node_and_prefill_pod_specs_get_the_same_kv_flags_and_a_rollback_restores_them_exactly() -> None:
    """Every vLLM container of the service (template, worker, prefill, prefill worker) reads its own
    VLLM_ADDITIONAL_ARGS: an FP8 decode beside a BF16 prefill would pair two KV-cache formats."""
    target = target_llminferenceservice()
    main = target["spec"]["template"]["containers"][0]
    target["spec"]["worker"] = {
        "containers": [{"name": "main", "env": [{"name": "VLLM_ADDITIONAL_ARGS", "value": BASE}]}]
    }
    target["spec"]["prefill"] = {"replicas": 1, "template": {"containers": [{"name": "main"}]}, "worker": {}}
    assert "prefill.worker" not in ISVC.companions({**target, "spec": {**target["spec"], "prefill": {}}}, None), (
        "no workers where the spec names none"
    )
    main["name"] = "main"
    before = ISVC.record(target, None)
    assert set(before.companions or {}) == {"worker", "prefill", "prefill.worker"}
    desired = ISVC.with_plan(before, FP8_PLAN)
    promoted = jsonpatch.apply_patch(target, ISVC.patch(target, None, desired))
    assert _main_env(promoted["spec"]["worker"]) == f"{BASE} {FP8}"
    assert _main_env(promoted["spec"]["prefill"]["template"]) == FP8
    assert _main_env(promoted["spec"]["prefill"]["worker"]) == FP8, "a main container added where the preset's is"
    assert ISVC.record(promoted, None) == desired and not drift.differences(desired, ISVC.record(promoted, None))
    assert "image" not in promoted["spec"]["worker"]["containers"][0], "the preset's image stays"
    canary = ISVC.canary(POLICY, "c", target, make_policy(**ISVC_REF).spec, FP8_PLAN)
    assert ISVC.record(canary, None) == desired, "the canary's every pod spec runs the plan"
    assert canary["spec"]["prefill"]["replicas"] == 1 and ISVC.serving_selector(canary)[
        "app.kubernetes.io/component"
    ] == ("llminferenceservice-workload-leader")
    restored = jsonpatch.apply_patch(promoted, ISVC.patch(promoted, None, before))
    assert ISVC.record(restored, None) == before
    edited = jsonpatch.apply_patch(promoted, [{"op": "add", "path": "/spec/prefill/template/containers/0/env/0/value",
                                               "value": "--kv-cache-dtype auto"}])  # fmt: skip
    found = drift.differences(desired, ISVC.record(edited, None))
    assert [item.field for item in found] == ["prefill KVArguments", "prefill Env"]
