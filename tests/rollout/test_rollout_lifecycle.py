"""Living with a rollout, on the pure step: drift after a decision, a target edited mid-rollout, Advisory mode,
approvals and retries bound to one rollout, and the notices a rollout's phase changes produce."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest
from kvpolicy.api.v1alpha1 import NotificationEvent
from kvpolicy.rollout import drift
from kvpolicy.rollout.rules import rollout_hash
from kvpolicy.rollout.step_types import Patch
from kvpolicy.rollout.targets.deployment import DeploymentTarget
from operator_helpers import (
    PATCHED_IMAGE,
    PROMOTED_ROLLOUT,
    TARGET_ARGS,
    TARGET_IMAGE,
    Driver,
    World,
    gpu,
    make_policy,
    run_to_canary,
    target_deployment,
)

FP8_FLAGS = ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]
# The quickest FP8 rollout: no gate Jobs, synthetic traffic, no bake.
DEPLOYMENT = DeploymentTarget()
QUICK = {"gates.accuracy.enabled": False, "rollout.traffic": "Synthetic"}


def vllm(deployment: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return result


def promote(driver: Driver) -> None:
    run_to_canary(driver)
    for _ in range(4):
        driver.tick()
    assert driver.phase == "Promoted", driver.policy.status.message


def gitops_revert(driver: Driver) -> None:
    """What a GitOps sync of the original manifest does to a promoted target: back to the BF16 image and args."""
    assert driver.world.target is not None
    container = vllm(driver.world.target)
    container["image"] = TARGET_IMAGE
    container["args"] = list(TARGET_ARGS)


def target_patches(driver: Driver) -> list[Patch]:
    return [
        action
        for result in driver.results
        for action in result.actions
        if isinstance(action, Patch) and action.name == "llama"
    ]


# ------------------------------------------------------------------------------------------------------ drift


def test_a_gitops_revert_of_a_promoted_target_raises_drifted_and_runs_the_gates_again() -> None:
    driver = Driver(make_policy(**QUICK))
    promote(driver)
    first_rollout = driver.policy.status.rollout_id
    driver.tick(300)
    assert driver.condition("Drifted") == ("False", "InSync")
    gitops_revert(driver)
    driver.tick(300)
    assert driver.phase == "CanaryStarting", "Reevaluate is the default after an FP8 decision"
    status = driver.policy.status
    assert driver.condition("Drifted") == ("True", "TargetDrifted")
    drifted = next(c for c in status.conditions if c.type == "Drifted")
    assert f"Image: {PATCHED_IMAGE} -> {TARGET_IMAGE}" in drifted.message
    assert "KVArguments: --kv-cache-dtype fp8 --attention-backend FLASH_ATTN -> (none)" in drifted.message
    assert status.rollout_id != first_rollout and status.rollout_run == 2
    assert status.previous_template is None, "the reverted target is the new baseline"
    assert "llama-fp8-canary-g1r2" in driver.world.deployments, "a new canary, named apart from the first run's"
    assert "TargetDrifted" in driver.reasons()
    driver.world.canary_up()
    for _ in range(4):
        driver.tick()
    assert driver.phase == "Promoted"
    assert vllm(driver.world.target)["args"] == [*TARGET_ARGS, *FP8_FLAGS]
    driver.tick(300)
    assert driver.condition("Drifted") == ("False", "InSync")
    assert driver.reasons()[-1] == "InSync"


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["spec"].update(replicas=7),
        lambda d: d["spec"]["template"]["metadata"]["labels"].update(team="search"),
        lambda d: d["spec"]["template"]["metadata"].update(annotations={"kubectl.kubernetes.io/restartedAt": "now"}),
        lambda d: d["metadata"].update(labels={"gitops": "synced"}),
        lambda d: vllm(d).update(resources={"limits": {"memory": "64Gi"}}),
        lambda d: vllm(d)["env"].insert(0, vllm(d)["env"].pop()),  # env order
    ],
    ids=["replicas", "pod-labels", "restart-annotation", "labels", "resources", "env-order"],
)
def test_changes_that_do_not_touch_serving_are_not_drift(edit: Any) -> None:
    driver = Driver(make_policy(**QUICK))
    promote(driver)
    assert driver.world.target is not None
    edit(driver.world.target)
    driver.tick(300)
    assert driver.phase == "Promoted"
    assert driver.condition("Drifted") == ("False", "InSync")
    assert driver.policy.status.drift is None
    assert "TargetDrifted" not in driver.reasons()


def test_on_drift_report_only_reports_once_and_never_writes() -> None:
    driver = Driver(make_policy(**QUICK, **{"rollout.onDrift": "Report"}))
    promote(driver)
    patches = len(target_patches(driver))
    assert driver.world.target is not None
    vllm(driver.world.target)["env"].append({"name": "VLLM_USE_V1", "value": "0"})
    for _ in range(3):
        driver.tick(300)
    assert driver.phase == "Promoted" and len(target_patches(driver)) == patches
    assert driver.condition("Drifted") == ("True", "DriftReported")
    assert driver.reasons().count("TargetDrifted") == 1
    assert driver.policy.status.drift is not None
    assert [d.describe() for d in driver.policy.status.drift.differences] == ["Env: VLLM_USE_V1 unset -> VLLM_USE_V1=0"]


def test_a_paused_policy_reports_drift_instead_of_reevaluating() -> None:
    driver = Driver(make_policy(**QUICK))
    promote(driver)
    driver.edit({"rollout.paused": True})
    gitops_revert(driver)
    driver.tick(300)
    assert driver.phase == "Promoted"
    assert driver.condition("Drifted") == ("True", "DriftReported")
    assert "spec.rollout.paused" in next(c.message for c in driver.policy.status.conditions if c.type == "Drifted")
    driver.edit({"rollout.paused": False})
    driver.tick(300)
    assert driver.phase == "CanaryStarting", "resuming re-evaluates the drift"


def test_held_bf16_reports_fp8_flags_a_gitops_sync_adds_instead_of_fighting_it() -> None:
    driver = Driver(make_policy(**{"workload.typicalContextTokens": 2048}))
    driver.tick()
    assert driver.phase == "HeldBF16"
    assert driver.world.target is not None
    vllm(driver.world.target)["args"] = [*TARGET_ARGS, "--kv-cache-dtype", "fp8"]
    for _ in range(3):
        driver.tick(300)
    assert driver.phase == "HeldBF16" and not target_patches(driver), "Report is the default after a BF16 decision"
    assert driver.condition("Drifted") == ("True", "DriftReported")
    driver.edit({"rollout.onDrift": "Reevaluate"})
    driver.tick(300)
    assert driver.phase == "HeldBF16"
    assert vllm(driver.world.target)["args"] == TARGET_ARGS, "Reevaluate plans BF16 again and applies it"
    driver.tick(300)
    assert driver.condition("Drifted") == ("False", "InSync")


def test_a_deleted_target_after_promotion_is_reported() -> None:
    driver = Driver(make_policy(**QUICK))
    promote(driver)
    driver.world.target = None
    driver.tick(300)
    assert driver.phase == "Promoted"
    assert driver.condition("Drifted") == ("True", "DriftReported")


def test_a_policy_promoted_by_an_older_operator_adopts_its_decision() -> None:
    driver = Driver(make_policy(**QUICK))
    promote(driver)
    status = driver.policy.status.model_copy(update={"target_decided": None, "target_base": None, "rollout_id": None})
    driver.policy = driver.policy.model_copy(update={"status": status})
    driver.tick(300)
    assert driver.phase == "Promoted" and driver.condition("Drifted") == ("False", "InSync")
    assert driver.policy.status.rollout_id is not None and driver.policy.status.target_decided is not None


def test_new_fields_do_not_change_the_rollout_hash() -> None:
    """Stored policies must not restart when the operator that knows these fields is installed."""
    plain = make_policy().spec
    steered = make_policy(
        **{
            "rollout.applyMode": "Advisory",
            "rollout.onDrift": "Report",
            "rollout.approvedRollout": "1-abcdef",
            "rollout.retryRollout": "1-abcdef",
            "notifications": [{"name": "ops", "urlSecretRef": {"name": "hook", "key": "url"}}],
        }
    ).spec
    assert rollout_hash(plain) == rollout_hash(steered)
    legacy = plain.to_k8s()
    del legacy["rollout"]["applyMode"]
    assert rollout_hash(type(plain).model_validate(legacy)) == rollout_hash(plain)


# ------------------------------------------------------------------------------------- target edited mid-rollout


def test_a_target_edited_mid_rollout_restarts_the_analysis_and_promotes_the_edit_with_the_kv_change() -> None:
    driver = Driver(make_policy())
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "AccuracyGate"
    assert driver.world.target is not None
    hotfix = [*TARGET_ARGS, "--max-num-seqs", "64"]
    vllm(driver.world.target)["args"] = hotfix
    driver.tick()
    assert "TargetChanged" in driver.reasons() and "AnalysisRestarted" in driver.reasons()
    changed = next(c for c in driver.policy.status.conditions if c.type == "Drifted")
    assert changed.reason == "TargetChanged" and "--max-num-seqs 64" in changed.message
    assert {"Deployment/llama-fp8-canary-g1", "Job/llama-fp8-accuracy-g1"} <= set(driver.world.deletes)
    assert driver.phase == "CanaryStarting"
    canary = driver.world.deployments["llama-fp8-canary-g1r2"]
    assert vllm(canary)["args"] == [*hotfix, *FP8_FLAGS], "the new canary gates the edited configuration"
    driver.world.canary_up()
    driver.tick()
    driver.world.finish_job("accuracy", json.dumps({"gate": "accuracy", "verdict": "Pass", "recovery": 0.99}))
    for _ in range(4):
        driver.tick()
        driver.world.canary_up()
    assert driver.phase == "Promoted", driver.policy.status.message
    assert vllm(driver.world.target)["args"] == [*hotfix, *FP8_FLAGS]


def test_on_blackwell_a_hand_edited_image_is_gated_and_kept_at_promotion() -> None:
    """The examples pin images.baseline; on a GPU that needs no patched image the canary must still run the target's
    image as it is, so a hotfix made mid-rollout is what is gated and what stays after promotion."""
    driver = Driver(make_policy(**QUICK, **{"images.baseline": TARGET_IMAGE}), World(gpu=gpu("B200")))
    run_to_canary(driver)
    assert driver.world.target is not None
    hotfix = "vllm/vllm-openai:v0.13.0-hotfix"
    vllm(driver.world.target)["image"] = hotfix
    driver.tick()
    assert "TargetChanged" in driver.reasons()
    restarted = driver.world.deployments["llama-fp8-canary-g1r2"]
    assert vllm(restarted)["image"] == hotfix, "the canary runs what the target runs"
    for _ in range(6):
        driver.world.canary_up()
        driver.tick()
    assert driver.phase == "Promoted", driver.policy.status.message
    assert vllm(driver.world.target)["image"] == hotfix


def test_a_target_edited_between_the_gates_and_the_patch_is_not_overwritten() -> None:
    driver = Driver(make_policy(**QUICK))
    run_to_canary(driver)
    while driver.policy.status.previous_template is None:  # ready, latency analysis, promoting: records the template
        driver.tick(settle=False)
    assert driver.phase == "Promoting" and not target_patches(driver)
    assert driver.world.target is not None
    vllm(driver.world.target)["image"] = "vllm:0.12.1-hotfix"
    driver.tick()
    assert not target_patches(driver), "the hotfix image was never gated: no promotion over it"
    assert "TargetChanged" in driver.reasons()
    assert driver.phase == "CanaryStarting"


def test_the_promotion_patch_fails_if_the_target_changed_after_it_was_observed() -> None:
    target = target_deployment()
    desired = DEPLOYMENT.record(target, None).model_copy(update={"image": PATCHED_IMAGE})
    patch = drift.advice("1-abcdef", DEPLOYMENT, target, None, desired)
    ops = json.loads(patch.json_patch)
    assert jsonpatch.apply_patch(target, ops)["spec"]["template"]["spec"]["containers"][0]["image"] == PATCHED_IMAGE
    edited = copy.deepcopy(target)
    vllm(edited)["image"] = "vllm:0.12.1-hotfix"
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(edited, ops)


# ------------------------------------------------------------------------------------------------------ Advisory


def rolled_out(world: World) -> None:
    """The target's Deployment controller has rolled its current template out to every pod."""
    assert world.target is not None
    replicas = world.target["spec"]["replicas"]
    generation = world.target["metadata"]["generation"]
    world.target["status"] = {
        "observedGeneration": generation,
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
    }


def test_advisory_publishes_the_change_and_is_promoted_only_when_the_target_runs_it() -> None:
    driver = Driver(make_policy(**QUICK, **{"rollout.applyMode": "Advisory"}))
    rolled_out(driver.world)
    run_to_canary(driver)
    for _ in range(3):
        driver.tick(60)
    assert driver.phase == "Promoting" and driver.condition("Promoted") == ("False", "AwaitingAdoption")
    assert not driver.world.deployments, "the canary's GPUs are freed while the change waits"
    advice = driver.policy.status.advice
    assert advice is not None and advice.rollout_id == driver.policy.status.rollout_id
    assert advice.image == PATCHED_IMAGE and advice.args == [*TARGET_ARGS, *FP8_FLAGS]
    assert "ChangeAdvised" in driver.reasons()
    driver.tick(3600)
    assert driver.phase == "Promoting", "an Advisory promotion waits as long as a review takes"
    # The GitOps repository takes the change (here: its JSON patch); then the Deployment rolls it out.
    assert driver.world.target is not None
    driver.world.target = jsonpatch.apply_patch(driver.world.target, json.loads(advice.json_patch))
    driver.world.target["metadata"]["generation"] += 1
    driver.tick()
    assert driver.phase == "Promoting", "the pods do not run it yet"
    rolled_out(driver.world)
    driver.tick()
    assert driver.phase == "Promoted"
    assert driver.policy.status.decision is not None and driver.policy.status.decision.reason == "Adopted"
    assert driver.world.target_patches == 0, "Advisory never writes the target"
    driver.tick(300)
    assert driver.condition("Drifted") == ("False", "InSync")


def test_the_advised_strategic_merge_patch_names_the_container_and_replaces_its_args() -> None:
    target = target_deployment()
    desired = DEPLOYMENT.record(target, None).model_copy(
        update={"image": PATCHED_IMAGE, "args": [*TARGET_ARGS, *FP8_FLAGS]}
    )
    advice = drift.advice("3-0a1b2c", DEPLOYMENT, target, None, desired)
    container = json.loads(advice.strategic_merge_patch)["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "vllm" and container["image"] == PATCHED_IMAGE
    assert container["args"] == [*TARGET_ARGS, *FP8_FLAGS]
    assert advice.summary.startswith(f"Image: {TARGET_IMAGE} -> {PATCHED_IMAGE}; KVArguments: (none) -> --kv-cache")


def test_advisory_held_bf16_advises_instead_of_stripping_flags() -> None:
    fp8_args = [*TARGET_ARGS, "--kv-cache-dtype", "fp8"]
    world = World(target=target_deployment(args=fp8_args))
    driver = Driver(make_policy(**{"workload.typicalContextTokens": 2048, "rollout.applyMode": "Advisory"}), world)
    driver.tick()
    assert driver.phase == "HeldBF16" and world.target_patches == 0
    advice = driver.policy.status.advice
    assert advice is not None and advice.args == TARGET_ARGS
    driver.tick(300)
    assert driver.condition("Drifted") == ("True", "DriftReported")


# ------------------------------------------------------------------------------------------ approvals and retries


def to_awaiting_approval(driver: Driver) -> None:
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "AwaitingApproval", driver.policy.status.message


def test_an_approval_does_not_approve_the_next_rollout() -> None:
    driver = Driver(make_policy(**QUICK, **{"rollout.approval": "Manual"}))
    to_awaiting_approval(driver)
    first = driver.policy.status.rollout_id
    assert first is not None and first.startswith("1-")
    assert any(first in e.message for r in driver.results for e in r.events if e.reason == "AwaitingApproval")
    driver.edit({"rollout.approvedRollout": first})
    driver.tick()
    driver.tick()
    driver.tick()
    assert driver.phase == "Promoted"
    driver.edit({"rollout.canaryReplicas": 2})  # a new rollout; the approval of the first stays in the spec
    driver.tick()
    driver.world.canary_up()
    driver.tick()
    driver.tick(600)
    assert driver.phase == "AwaitingApproval", "the first rollout's approval approves nothing else"
    second = driver.policy.status.rollout_id
    assert second != first
    assert f"names rollout {first}, not this one ({second})" in (driver.policy.status.message or "")


def test_an_approval_of_a_restarted_rollout_at_the_same_generation_does_not_carry_over() -> None:
    driver = Driver(make_policy(**QUICK, **{"rollout.approval": "Manual"}))
    run_to_canary(driver)
    first = driver.policy.status.rollout_id
    driver.edit({"rollout.approvedRollout": first})  # approved ahead, while the canary starts
    assert driver.world.target is not None
    vllm(driver.world.target)["image"] = "vllm:0.12.1-hotfix"
    driver.tick()  # the target changed: the analysis restarts as another rollout
    assert driver.policy.status.rollout_id != first
    driver.world.canary_up()
    driver.tick()
    driver.tick()
    assert driver.phase == "AwaitingApproval"


def test_the_deprecated_approved_flag_approves_nothing_and_says_what_to_set() -> None:
    driver = Driver(make_policy(**QUICK, **{"rollout.approval": "Manual", "rollout.approved": True}))
    to_awaiting_approval(driver)
    driver.tick(600)
    assert driver.phase == "AwaitingApproval"
    warning = next(e for r in driver.results for e in r.events if e.reason == "DeprecatedApproval")
    assert f"spec.rollout.approvedRollout to {driver.policy.status.rollout_id}" in warning.message


def test_retry_runs_a_rolled_back_rollout_again_once() -> None:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 100}))
    driver.tick()
    driver.tick(101)
    driver.tick()
    assert driver.phase == "RolledBack"
    failed = driver.policy.status.rollout_id
    driver.edit({"rollout.retryRollout": "1-ffffff"})
    driver.tick()
    assert driver.phase == "RolledBack", "a retry names the rollout it retries"
    driver.edit({"rollout.retryRollout": failed})
    driver.tick()
    assert driver.phase == "CanaryStarting" and "RetryRequested" in driver.reasons()
    assert driver.policy.status.rollout_id != failed
    driver.tick(101)
    driver.tick()
    assert driver.phase == "RolledBack"
    driver.tick(300)
    assert driver.phase == "RolledBack", "the retry token is spent: it named the previous rollout"


# ------------------------------------------------------------------------------------------------------ notices


def test_every_phase_change_of_a_rollout_is_a_notice_in_order() -> None:
    driver = Driver(make_policy())
    run_to_canary(driver)
    driver.tick()
    driver.world.finish_job("accuracy", json.dumps({"gate": "accuracy", "verdict": "Pass", "recovery": 0.99}))
    for _ in range(4):
        driver.tick()
        driver.world.canary_up()
    assert driver.phase == "Promoted"
    notices = [n for r in driver.results for n in r.notices]
    changes = [(n.previous_phase, n.phase) for n in notices if n.kind == NotificationEvent.PHASE_CHANGED]
    assert changes == PROMOTED_ROLLOUT
    decided = [n for n in notices if n.kind == NotificationEvent.DECIDED]
    assert len(decided) == 1 and decided[0].decision is not None and decided[0].decision.result == "Promoted"
    assert all(n.rollout_id == driver.policy.status.rollout_id for n in notices)
    assert all(n.message for n in notices)
