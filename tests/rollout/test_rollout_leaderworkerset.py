"""A LeaderWorkerSet target (multi-host vLLM): leader and worker templates change together, the canary is a second
LeaderWorkerSet, the gates and scrapes reach the leaders, and the parallel sizes stay the target's."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from kvpolicy.api.v1alpha1 import Parallelism, PodTemplateRecord, TargetRef
from kvpolicy.rollout import builders as b
from kvpolicy.rollout import drift
from kvpolicy.rollout.targets.leaderworkerset import LeaderWorkerSetTarget
from operator_helpers import (
    LWS_LEADER_ARGS,
    LWS_WORKER_ARGS,
    TARGET_IMAGE,
    Driver,
    World,
    gate_output,
    make_policy,
    target_leaderworkerset,
)
from pydantic import ValidationError
from test_rollout_builders import FP8_PLAN

LWS = LeaderWorkerSetTarget()
POLICY = b.PolicyRef(name="llama-fp8", namespace="serving", uid="uid-1")
LWS_REF = {"targetRef.kind": "LeaderWorkerSet", "targetRef.apiVersion": "leaderworkerset.x-k8s.io/v1"}
FP8_FLAGS = ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window"]


def _template(obj: dict[str, Any], key: str) -> dict[str, Any]:
    template: dict[str, Any] = obj["spec"]["leaderWorkerTemplate"][key]
    return template


def _args(obj: dict[str, Any], key: str) -> list[str]:
    args: list[str] = _template(obj, key)["spec"]["containers"][0]["args"]
    return args


def test_a_targetref_names_a_leaderworkerset_only_at_its_api_version() -> None:
    TargetRef.model_validate({"kind": "LeaderWorkerSet", "apiVersion": "leaderworkerset.x-k8s.io/v1", "name": "l"})
    with pytest.raises(ValidationError, match=r"\(LeaderWorkerSet apps/v1\)"):
        TargetRef.model_validate({"kind": "LeaderWorkerSet", "apiVersion": "apps/v1", "name": "l"})


def test_the_canary_is_a_second_leaderworkerset_whose_leader_and_workers_run_the_plan() -> None:
    target = target_leaderworkerset()
    spec = make_policy(**LWS_REF).spec
    canary = LWS.canary(POLICY, "llama-fp8-canary-g1", target, spec, FP8_PLAN)
    assert canary["kind"] == "LeaderWorkerSet" and canary["spec"]["replicas"] == spec.rollout.canary_replicas
    assert canary["spec"]["leaderWorkerTemplate"]["size"] == 2, "groups of the target's size"
    assert _args(canary, "leaderTemplate") == [*LWS_LEADER_ARGS, *FP8_FLAGS]
    assert _args(canary, "workerTemplate") == [*LWS_WORKER_ARGS, *FP8_FLAGS], "no group mixes FP8 and BF16 caches"
    for key in ("leaderTemplate", "workerTemplate"):
        assert _template(canary, key)["spec"]["containers"][0]["image"] == "patched:1"
        labels = _template(canary, key)["metadata"]["labels"]
        assert "app" not in labels and labels[b.ROLE_LABEL] == b.ROLE_CANARY, "no Service of the target selects it"
    assert _template(canary, "leaderTemplate")["metadata"]["labels"][b.CANARY_LABEL] == "llama-fp8-canary-g1"
    assert b.CANARY_LABEL not in _template(canary, "workerTemplate")["metadata"]["labels"], "gates reach leaders only"
    record = LWS.record(canary, None)
    assert b.parallelism(record) == Parallelism(tensor=8, pipeline=2) == b.parallelism(LWS.record(target, None))
    assert target == target_leaderworkerset(), "the target is not modified"


def test_a_canary_of_a_set_without_a_leader_template_gets_one_so_only_its_leaders_carry_the_canary_label() -> None:
    target = target_leaderworkerset()
    del target["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    canary = LWS.canary(POLICY, "c", target, make_policy(**LWS_REF).spec, FP8_PLAN)
    assert _template(canary, "leaderTemplate")["metadata"]["labels"][b.CANARY_LABEL] == "c"
    assert _args(canary, "leaderTemplate") == [*LWS_WORKER_ARGS, *FP8_FLAGS]


def test_promotion_and_rollback_patch_the_leader_and_every_worker_together() -> None:
    target = target_leaderworkerset()
    before = LWS.record(target, None)
    promoted = jsonpatch.apply_patch(target, LWS.patch(target, None, LWS.with_plan(before, FP8_PLAN)))
    assert _args(promoted, "leaderTemplate") == [*LWS_LEADER_ARGS, *FP8_FLAGS]
    assert _args(promoted, "workerTemplate") == [*LWS_WORKER_ARGS, *FP8_FLAGS]
    assert {
        _template(promoted, key)["spec"]["containers"][0]["image"] for key in ("leaderTemplate", "workerTemplate")
    } == {"patched:1"}
    restored = jsonpatch.apply_patch(promoted, LWS.patch(promoted, None, before))
    assert restored == target
    # A patch computed against an old object tests the worker's arguments too: a worker edited since fails it.
    edited = copy.deepcopy(target)
    _args(edited, "workerTemplate").append("--enforce-eager")
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(edited, LWS.patch(target, None, LWS.with_plan(before, FP8_PLAN)))


def test_a_worker_template_edited_by_hand_is_a_changed_target() -> None:
    target = target_leaderworkerset()
    base = LWS.record(target, None)
    edited = copy.deepcopy(target)
    _args(edited, "workerTemplate").append("--enforce-eager")
    (found,) = drift.differences(base, LWS.record(edited, None))
    assert found.field == "worker Arguments"


def test_ray_workers_take_the_leaders_configuration_and_keep_their_command() -> None:
    ray = ["ray", "start", "--address=$(LWS_LEADER_ADDRESS):6379", "--block"]
    target = target_leaderworkerset(worker_args=ray)
    promoted = jsonpatch.apply_patch(target, LWS.patch(target, None, LWS.with_plan(LWS.record(target, None), FP8_PLAN)))
    assert _args(promoted, "workerTemplate") == ray
    assert _template(promoted, "workerTemplate")["spec"]["containers"][0]["image"] == TARGET_IMAGE


def test_the_gates_and_scrapes_reach_the_leaders_and_the_canary_joins_on_the_leaders_labels() -> None:
    target = target_leaderworkerset()
    assert LWS.serving_selector(target) == {
        "leaderworkerset.sigs.k8s.io/name": "llama",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    canary = LWS.canary(POLICY, "c", target, make_policy(**LWS_REF).spec, FP8_PLAN)
    assert not LWS.is_joined(canary, target)
    joined = copy.deepcopy(canary)
    patch = LWS.join_patch(POLICY, "c", target)
    joined["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"] = patch["spec"]["leaderWorkerTemplate"][
        "leaderTemplate"
    ]["metadata"]
    assert LWS.is_joined(joined, target) and LWS.traffic_labels(joined)[b.CANARY_LABEL] == "c"
    assert LWS.serving_port(target, None) == 8000
    assert LWS.pod_spec(target)["nodeSelector"] == {"pool": "h200"}, "GPU Jobs land on the leaders' pool"


def test_the_advice_for_a_gitops_repository_is_a_merge_patch_of_both_templates() -> None:
    target = target_leaderworkerset()
    desired = LWS.with_plan(LWS.record(target, None), FP8_PLAN)
    advice = drift.advice("1-abcdef", LWS, target, None, desired)
    merged = LWS.advice_patch(target, None, desired)
    assert set(merged["spec"]["leaderWorkerTemplate"]) == {"leaderTemplate", "workerTemplate"}
    assert jsonpatch.apply_patch(target, jsonpatch.JsonPatch.from_string(advice.json_patch)) == jsonpatch.apply_patch(
        target, LWS.patch(target, None, desired)
    )


def lws_driver(**spec: Any) -> Driver:
    return Driver(make_policy(**LWS_REF, **spec), World(target=target_leaderworkerset(), kind=LWS))


def test_a_leaderworkerset_is_promoted_leader_and_workers_together() -> None:
    driver = lws_driver()
    driver.tick()
    assert driver.phase == "CanaryStarting"
    assert driver.policy.status.canary is not None
    assert driver.policy.status.canary.parallelism == Parallelism(tensor=8, pipeline=2)
    assert driver.condition("Planned") is not None
    assert "LeaderWorkerSet/llama-fp8-canary-g1" in driver.world.creates
    driver.world.canary_up()
    driver.tick()
    assert driver.phase == "AccuracyGate"
    driver.world.finish_job("accuracy", gate_output("Pass", recovery=1.0, canaryScore=0.9, baselineScore=0.9))
    for _ in range(6):
        driver.world.canary_up()
        driver.tick(10)
    assert driver.phase == "Promoted", driver.reasons()
    assert driver.world.target is not None
    assert _args(driver.world.target, "leaderTemplate") == [*LWS_LEADER_ARGS, *FP8_FLAGS[:2], *_plan_tail(driver)]
    assert b.kv_cache_dtype(_args(driver.world.target, "workerTemplate")) == "fp8"
    assert driver.world.deployments == {}, "the canary LeaderWorkerSet is gone"


def _plan_tail(driver: Driver) -> list[str]:
    plan = driver.policy.status.plan
    assert plan is not None
    return plan.extra_args[2:]


def test_a_leaderworkerset_whose_canary_fails_the_accuracy_gate_is_left_as_it_was() -> None:
    driver = lws_driver()
    driver.tick()
    driver.world.canary_up()
    driver.tick()
    driver.world.finish_job("accuracy", gate_output("Fail", recovery=0.4, canaryScore=0.36, baselineScore=0.9))
    for _ in range(3):
        driver.tick(10)
    assert driver.phase == "RolledBack"
    assert driver.world.target == target_leaderworkerset() and driver.world.target_patches == 0
    assert driver.world.deployments == {}


def test_a_canary_whose_parallel_sizes_differ_from_the_targets_is_rolled_back_before_any_gate() -> None:
    driver = lws_driver()
    driver.tick()
    [canary] = driver.world.deployments.values()
    args = _args(canary, "leaderTemplate")
    args[args.index("--tensor-parallel-size") + 1] = "4"
    driver.world.canary_up()
    driver.tick()
    assert driver.phase in ("RollingBack", "RolledBack")
    decision = driver.policy.status.decision
    assert decision is not None and decision.reason == "CanaryConfigMismatch"
    assert "tensor 4" in decision.message and "tensor 8" in decision.message


def test_parallel_sizes_are_read_in_every_form_vllm_accepts() -> None:
    def sizes(*args: str) -> Parallelism:
        return b.parallelism(PodTemplateRecord(image="i", args=list(args)))

    assert sizes() == Parallelism()
    assert sizes("-tp", "4", "--pipeline_parallel_size=2", "-dp", "3") == Parallelism(tensor=4, pipeline=2, data=3)
    assert sizes("--tensor-parallel-size=2", "--tensor-parallel-size", "8") == Parallelism(tensor=8)
