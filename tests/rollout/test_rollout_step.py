"""Table tests of the pure rollout step: every transition and failure path, replayed against an in-memory world."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from kvpolicy.analysis.model import LatencyGateConfig, SideMetrics
from kvpolicy.analysis.verdicts import assess
from kvpolicy.api.reasons import GateReason
from kvpolicy.api.v1alpha1 import GateVerdict, LatencyAnalysis
from kvpolicy.gate_programs.report import read_report
from kvpolicy.rollout.latency_phase import analysis_state
from kvpolicy.rollout.rules import analysis_window_seconds, latency_check_due, phase_deadline, rollout_hash
from kvpolicy.rollout.step import step
from kvpolicy.rollout.step_types import Create, Delete, Kind, Patch, PodView
from operator_helpers import (
    CONFIG,
    PATCHED_IMAGE,
    ROLLED_OUT,
    T0,
    TARGET_ARGS,
    TARGET_IMAGE,
    Driver,
    JobView,
    World,
    gate_output,
    gpu,
    live,
    make_policy,
    run_to_canary,
    target_deployment,
    to_accuracy_gate,
    verdict,
)

PASS = gate_output(
    "Pass", reason="RecoveryAboveMinimum", recovery=0.98, recoveryLow=0.96, recoveryHigh=0.99, lengthTokens=131072
)
FAIL = gate_output(
    "Fail", reason="RecoveryBelowMinimum", recovery=0.14, recoveryLow=0.1, recoveryHigh=0.2, lengthTokens=131072
)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return result


def test_hopper_plan_starts_an_isolated_canary_with_the_patched_image() -> None:
    driver = Driver(make_policy())
    result = driver.tick()
    assert driver.phase == "CanaryStarting"
    assert driver.condition("Planned") == ("True", "FP8Planned")
    created = {(a.kind, a.name) for a in result.actions if isinstance(a, Create)}
    assert created == {
        (Kind.DEPLOYMENT, "llama-fp8-canary-g1"),
        (Kind.SERVICE, "llama-fp8-canary-g1"),
        (Kind.SERVICE, "llama-fp8-baseline-g1"),
    }
    canary = driver.world.deployments["llama-fp8-canary-g1"]
    assert container(canary)["image"] == PATCHED_IMAGE
    assert container(canary)["args"][-4:] == ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]
    labels = canary["spec"]["template"]["metadata"]["labels"]
    assert "app" not in labels and "tier" not in labels, "the canary must not match the target's Service"
    assert canary["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert driver.world.services["llama-fp8-baseline-g1"]["spec"]["selector"] == {"app": "llama"}


def test_hopper_fixed_image_passes_every_gate_and_promotes_the_target() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    job = driver.world.jobs["llama-fp8-accuracy-g1"]
    command = container(job)["command"] if "containers" in job["spec"]["template"]["spec"] else []
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["kvpolicy", "gate", "accuracy"]
    assert command[command.index("--length") + 1] == str(131072 - 128), "room for the answer"
    assert command[command.index("--canary") + 1] == "http://llama-fp8-canary-g1.serving.svc:8000"
    assert command[command.index("--baseline") + 1] == "http://llama-fp8-baseline-g1.serving.svc:8000"

    driver.world.finish_job("accuracy", PASS)
    start = len(driver.results)
    driver.tick()
    assert driver.phase == "LatencyAnalysis"
    assert driver.condition("AccuracyGatePassed") == ("True", "RecoveryAboveMinimum")
    # Issue 23 item 6: the pod that passed the accuracy gate joins the users' Service as it runs (its labels), not
    # through the canary's template, which would replace it with a cold pod.
    joins = [a for r in driver.results[start:] for a in r.actions if isinstance(a, Patch)]
    assert [(a.kind, a.name) for a in joins] == [(Kind.POD, "llama-fp8-canary-g1-0")]
    canary_labels = driver.world.deployments["llama-fp8-canary-g1"]["spec"]["template"]["metadata"]["labels"]
    assert "app" not in canary_labels and canary_labels["kvpolicy.dev/role"] == "canary", "template unchanged"
    pod = driver.world.pods["llama-fp8-canary-g1-0"]
    assert pod.ready and pod.labels["app"] == "llama" and pod.labels["kvpolicy.dev/canary"] == "llama-fp8-canary-g1"

    start = len(driver.results)
    driver.tick()  # joined and still ready, no pod replaced: bake 0 and latency gate disabled -> promoting
    recorded = next(r for r in driver.results[start:] if r.status.previous_template is not None)
    assert not [a for a in recorded.actions if isinstance(a, Patch)], "record the template before patching"
    assert recorded.status.previous_template.image == TARGET_IMAGE
    assert driver.world.target_patches == 1
    assert "Deployment/llama-fp8-canary-g1" in driver.world.deletes
    driver.tick()
    assert driver.phase == "Promoted"
    assert driver.policy.status.decision.result == "Promoted"
    target = container(driver.world.target)
    assert target["image"] == PATCHED_IMAGE
    assert target["args"] == [*TARGET_ARGS, "--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]
    assert driver.condition("Promoted") == ("True", "GatesPassed")
    assert {"Planned", "CanaryReady", "AccuracyGatePassed", "TrafficJoined", "Promoting", "Promoted"} <= set(
        driver.reasons()
    )


def test_blackwell_promotes_without_the_patched_image() -> None:
    driver = Driver(make_policy(), World(gpu=gpu("B200")))
    run_to_canary(driver)
    canary = driver.world.deployments["llama-fp8-canary-g1"]
    assert container(canary)["image"] == TARGET_IMAGE
    assert "FLASHINFER" in container(canary)["args"]


def test_unfixed_hopper_image_fails_the_accuracy_gate_and_rolls_back() -> None:
    driver = Driver(make_policy(**{"images.fp8PatchedFeatures": ["FastHeadDim256"], "kvCache.dtype": "FP8"}))
    driver.tick()
    assert driver.phase == "HeldBF16", "without a two-level image FP8 is refused on Hopper"
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.world.finish_job("accuracy", FAIL, exit_code=1)
    driver.tick()
    assert driver.phase == "RollingBack"
    decision = driver.policy.status.decision
    assert decision.reason == "AccuracyRecoveryBelowMinimum"
    assert "accuracy recovery 0.14" in decision.message and "minRecovery 0.95" in decision.message
    assert driver.condition("AccuracyGatePassed") == ("False", "RecoveryBelowMinimum")
    driver.tick()
    assert driver.phase == "RolledBack"
    assert driver.condition("RolledBack") == ("True", "AccuracyRecoveryBelowMinimum")
    assert driver.world.target_patches == 0 and driver.world.target == target_deployment()
    assert not driver.world.deployments and not driver.world.services
    assert driver.policy.status.accuracy.recovery == pytest.approx(0.14)


@pytest.mark.parametrize(
    ("output", "exit_code", "failure", "reason"),
    [
        (gate_output("Inconclusive", reason="SampleCapReached", recovery=0.9), 2, None, "AccuracyInconclusive"),
        (None, 137, "DeadlineExceeded", "AccuracyGateError"),
        ("Traceback (most recent call last): boom", 1, "BackoffLimitExceeded", "AccuracyGateError"),
    ],
)
def test_accuracy_gate_without_a_pass_rolls_back(
    output: str | None, exit_code: int, failure: str | None, reason: str
) -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.world.finish_job("accuracy", output, exit_code=exit_code, failure=failure)
    driver.tick()
    assert driver.policy.status.decision.reason == reason
    if failure:
        assert failure in driver.policy.status.decision.message


def test_accuracy_gate_timeout_deletes_the_job_and_rolls_back() -> None:
    driver = Driver(make_policy(**{"gates.accuracy.timeoutSeconds": 60}))
    to_accuracy_gate(driver)
    driver.tick(30)
    assert driver.phase == "AccuracyGate"
    driver.tick(31)
    assert driver.policy.status.decision.reason == "AccuracyGateTimeout"
    assert "Job/llama-fp8-accuracy-g1" in driver.world.deletes


def test_short_context_holds_bf16_without_a_canary() -> None:
    driver = Driver(make_policy(**{"workload.maxContextTokens": 4096, "workload.typicalContextTokens": 2048}))
    result = driver.tick()
    assert driver.phase == "HeldBF16"
    assert driver.policy.status.decision.reason == "BelowDecodeBreakEven"
    assert not result.actions and not driver.world.creates
    assert driver.condition("Planned") == ("True", "BF16Planned")
    assert result.requeue_after == CONFIG.idle_seconds


def test_held_bf16_strips_fp8_flags_someone_set_by_hand() -> None:
    fp8_args = [*TARGET_ARGS, "--kv-cache-dtype=fp8", "--kv-cache-dtype-skip-layers", "0", "1"]
    world = World(target=target_deployment(args=fp8_args))
    driver = Driver(make_policy(**{"workload.typicalContextTokens": 2048}), world)
    driver.tick()
    assert driver.phase == "HeldBF16"
    assert container(world.target)["args"] == TARGET_ARGS


@pytest.mark.parametrize(
    ("unschedulable", "reason"),
    [("0/2 nodes: Insufficient nvidia.com/gpu", "CapacityUnavailable"), (None, "ProgressDeadlineExceeded")],
)
def test_canary_never_ready_rolls_back_at_the_progress_deadline(unschedulable: str | None, reason: str) -> None:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 120}))
    driver.tick()
    driver.world.canary_up(ready=False, unschedulable=unschedulable)
    driver.tick()
    driver.tick(60)
    if unschedulable:
        assert driver.condition("CapacityAvailable") == ("False", "Unschedulable")
        assert driver.reasons().count("CanaryUnschedulable") == 1
    assert driver.phase == "CanaryStarting"
    driver.tick(61)
    assert driver.phase == "RollingBack"
    assert driver.policy.status.decision.reason == reason
    driver.tick()
    assert driver.phase == "RolledBack" and not driver.world.deployments


@pytest.mark.parametrize("settles", [True, False])
def test_the_gates_wait_for_a_target_still_rolling_out(settles: bool) -> None:
    """After a promotion the target's pods restart: a new rollout's gates would find no baseline pod ready, or a mix
    of two configurations. They start once the target is rolled out, or the rollout ends at the progress deadline."""
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 120}))
    assert driver.world.target is not None
    driver.world.target["status"] = {"observedGeneration": 1, "replicas": 3, "updatedReplicas": 1, "readyReplicas": 1}
    run_to_canary(driver)
    driver.tick(60)
    assert driver.phase == "CanaryStarting"
    assert "waiting for llama to finish rolling out" in driver.policy.status.message
    if settles:
        driver.world.target["status"] = dict(ROLLED_OUT)
        driver.tick(30)
        assert driver.phase == "AccuracyGate"
        return
    driver.tick(61)
    assert driver.phase == "RollingBack"
    assert driver.policy.status.decision.reason == "ProgressDeadlineExceeded"
    assert "rolling out" in driver.policy.status.decision.message


def test_abort_mid_gate_deletes_the_running_job_and_clearing_it_restarts() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.edit({"rollout.abort": True})
    driver.tick()
    assert driver.policy.status.decision.reason == "Aborted"
    assert "Job/llama-fp8-accuracy-g1" in driver.world.deletes
    driver.tick()
    assert driver.phase == "RolledBack"
    driver.tick()
    assert driver.phase == "RolledBack", "abort holds while it is set"
    driver.edit({"rollout.abort": False})
    driver.tick()
    assert driver.phase == "CanaryStarting" and "RolloutRestarted" in driver.reasons()
    assert "llama-fp8-canary-g3" in driver.world.deployments


def test_paused_holds_and_resuming_restarts_the_phase_deadline() -> None:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 100}))
    driver.tick()
    driver.world.canary_up(ready=False)
    driver.edit({"rollout.paused": True})
    first = driver.tick(90)
    second = driver.tick(90)
    assert not first.actions and not second.actions
    assert driver.phase == "CanaryStarting" and driver.condition("Paused") == ("True", "Paused")
    assert driver.reasons().count("RolloutPaused") == 1
    driver.edit({"rollout.paused": False})
    driver.tick(1)
    assert driver.phase == "CanaryStarting", "the deadline restarts when the rollout resumes"
    assert "RolloutResumed" in driver.reasons()
    assert "llama-fp8-canary-g1" in driver.world.deployments, "a control field must not restart the rollout"


def test_spec_change_mid_rollout_restarts_the_analysis() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.edit({"gates.accuracy.minRecovery": "0.97"})
    driver.tick()
    assert "AnalysisRestarted" in driver.reasons()
    assert {"Deployment/llama-fp8-canary-g1", "Job/llama-fp8-accuracy-g1"} <= set(driver.world.deletes)
    driver.tick()
    assert driver.phase == "CanaryStarting"
    assert set(driver.world.deployments) == {"llama-fp8-canary-g2"}
    assert driver.policy.status.rollout_generation == 2


def test_control_fields_do_not_change_the_rollout_hash() -> None:
    base = make_policy().spec
    controlled = make_policy(**{"rollout.paused": True, "rollout.approved": True, "rollout.abort": True}).spec
    assert rollout_hash(base) == rollout_hash(controlled)
    assert rollout_hash(base) != rollout_hash(make_policy(**{"rollout.canaryReplicas": 2}).spec)


def test_manual_approval_holds_before_promotion() -> None:
    driver = Driver(make_policy(**{"rollout.approval": "Manual", "gates.accuracy.enabled": False}))
    run_to_canary(driver)
    driver.tick()  # ready -> latency: join
    driver.world.canary_up()
    driver.tick()
    assert driver.phase == "AwaitingApproval"
    driver.tick(600)
    assert driver.phase == "AwaitingApproval" and driver.world.target_patches == 0
    driver.edit({"rollout.approvedRollout": driver.policy.status.rollout_id})
    driver.tick()
    assert driver.phase == "Promoting"
    assert "Approved" in driver.reasons()


def test_replaying_a_step_repeats_only_idempotent_actions() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    observed = driver.world.observe(driver.now + timedelta(seconds=1))
    first = step(driver.policy, observed, CONFIG)
    again = step(driver.policy, observed, CONFIG)
    assert first == again
    assert not [a for a in first.actions if isinstance(a, Create) and a.kind == Kind.JOB], "the Job exists already"


def test_operator_restart_before_the_status_write_does_not_duplicate_the_job() -> None:
    driver = Driver(make_policy())
    run_to_canary(driver)
    stale_policy = driver.policy
    driver.tick()  # creates the Job; pretend the status write was lost
    driver.policy = stale_policy
    driver.tick()
    assert driver.phase == "AccuracyGate"
    assert driver.world.creates.count("Job/llama-fp8-accuracy-g1") == 1


def test_abort_after_promotion_restores_the_recorded_template_exactly() -> None:
    driver = Driver(make_policy(**{"gates.accuracy.enabled": False, "rollout.traffic": "Synthetic"}))
    run_to_canary(driver)
    for _ in range(3):
        driver.tick()
    assert driver.phase == "Promoted"
    assert container(driver.world.target)["image"] == PATCHED_IMAGE
    driver.edit({"rollout.abort": True})
    driver.tick()
    driver.tick()
    assert driver.phase == "RolledBack"
    assert driver.world.target == target_deployment()
    assert driver.policy.status.previous_template is None


@pytest.mark.parametrize(
    ("output", "exit_code", "phase", "reason"),
    [
        ('{"verdict": "Safe"}', 0, "AccuracyGate", "AccumulationSafe"),
        ('{"verdict": "Unsafe", "message": "cliff at 65536"}', 1, "RollingBack", "AccumulationUnsafe"),
        (None, 2, "AccuracyGate", "PreflightInconclusive"),
    ],
)
def test_gpu_preflight_outcomes(output: str | None, exit_code: int, phase: str, reason: str) -> None:
    driver = Driver(make_policy(**{"gates.gpuPreflight.enabled": True}))
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "GpuPreflight"
    job = driver.world.jobs["llama-fp8-preflight-g1"]
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"pool": "h200"}
    assert pod_spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert pod_spec["containers"][0]["image"] == "probe:test"
    driver.world.finish_job("preflight", output, exit_code=exit_code)
    driver.tick()
    assert driver.phase == phase
    assert driver.condition("PreflightPassed")[1] == reason
    if reason == "PreflightInconclusive":
        assert "PreflightInconclusive" in driver.reasons()


def synthetic(**spec: Any) -> Driver:
    driver = Driver(
        make_policy(
            **{"gates.accuracy.enabled": False, "gates.latency.enabled": True, "rollout.traffic": "Synthetic", **spec}
        )
    )
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "LatencyAnalysis"
    return driver


def test_synthetic_traffic_never_joins_and_the_probe_decides_after_the_bake() -> None:
    driver = synthetic(**{"rollout.bakeSeconds": 100})
    canary = driver.world.deployments["llama-fp8-canary-g1"]
    assert "app" not in canary["spec"]["template"]["metadata"]["labels"]
    command = driver.world.jobs["llama-fp8-latency-g1"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["kvpolicy", "gate", "latency"]
    driver.world.finish_job("latency", '{"gate": "latency", "verdict": "Pass", "message": "ok"}')
    result = driver.tick(10)
    assert driver.phase == "LatencyAnalysis" and driver.condition("LatencyGatePassed") == ("Unknown", "Baking")
    assert 0 < result.requeue_after <= 89
    driver.tick(90)
    assert driver.phase == "Promoting"


@pytest.mark.parametrize(
    ("verdict", "on_inconclusive", "phase", "reason"),
    [
        ("Breach", "Hold", "RollingBack", "LatencyBreach"),
        ("Inconclusive", "Hold", "LatencyAnalysis", None),
        ("Inconclusive", "Rollback", "RollingBack", "LatencyInconclusive"),
    ],
)
def test_synthetic_probe_failures(verdict: str, on_inconclusive: str, phase: str, reason: str | None) -> None:
    driver = synthetic(**{"gates.latency.onInconclusive": on_inconclusive})
    driver.world.finish_job("latency", f'{{"verdict": "{verdict}", "message": "ttft 1.4x"}}', exit_code=1)
    driver.tick()
    assert driver.phase == phase
    if reason:
        assert driver.policy.status.decision.reason == reason
    else:
        assert driver.condition("LatencyGatePassed") == ("Unknown", "LatencyInconclusive")


def test_the_analysis_window_reads_only_the_traffic_since_the_join() -> None:
    """A warm canary's histograms hold the accuracy gate's long prompts: a check must not read back past the join."""
    driver = live(**{"gates.latency.windowSeconds": 60, "gates.latency.intervalSeconds": 10})
    joined = driver.now
    assert analysis_window_seconds(driver.policy, joined + timedelta(seconds=10)) == 10
    assert analysis_window_seconds(driver.policy, joined + timedelta(seconds=59.5)) == 59
    assert analysis_window_seconds(driver.policy, joined + timedelta(minutes=30)) == 60


def test_live_analysis_promotes_after_enough_passing_checks() -> None:
    driver = live(
        **{"rollout.bakeSeconds": 120, "gates.latency.windowSeconds": 60, "gates.latency.intervalSeconds": 60}
    )
    # The first check reads the traffic of the interval after the join: none is due at the join itself.
    assert not latency_check_due(driver.policy, driver.now)
    assert latency_check_due(driver.policy, driver.now + timedelta(seconds=60))
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    assert driver.phase == "LatencyAnalysis"
    assert not latency_check_due(driver.policy, driver.now + timedelta(seconds=30))
    driver.tick(60, latency_verdict=verdict(GateVerdict.PASS))
    assert driver.phase == "Promoting"
    assert driver.condition("LatencyGatePassed") == ("True", "AnalysisPassed")
    assert driver.policy.status.latency.passes == 2


def test_live_analysis_rolls_back_after_consecutive_breaches() -> None:
    driver = live(**{"gates.latency.consecutiveFailureLimit": 2})
    driver.tick(60, latency_verdict=verdict(GateVerdict.BREACH))
    assert driver.phase == "LatencyAnalysis" and driver.reasons().count("LatencyBreach") == 1
    driver.tick(60, latency_verdict=verdict(GateVerdict.BREACH))
    assert driver.phase == "RollingBack"
    assert driver.policy.status.latency.consecutive_failures == 2


def test_live_analysis_without_data_holds_after_the_stall_deadline() -> None:
    driver = live(**{"gates.latency.inconclusiveDeadlineSeconds": 100})
    driver.tick(60, latency_verdict=verdict(GateVerdict.NO_DATA))
    driver.tick(120, latency_verdict=verdict(GateVerdict.NO_DATA))
    assert driver.phase == "LatencyAnalysis"
    assert driver.condition("LatencyGatePassed") == ("Unknown", "AnalysisStalled")


def test_target_disappearing_mid_rollout_rolls_back() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    driver.world.target = None
    driver.tick()
    assert driver.policy.status.decision.reason == "TargetNotFound"
    driver.tick()
    assert driver.phase == "RolledBack"


def test_missing_target_while_planning_waits_with_one_event() -> None:
    driver = Driver(make_policy(), World(target=None))
    driver.tick()
    driver.tick()
    assert driver.phase == "Planning"
    assert driver.condition("Planned") == ("False", "TargetNotFound")
    assert driver.reasons().count("TargetNotFound") == 1


def test_unknown_container_is_reported() -> None:
    driver = Driver(make_policy(**{"targetRef.container": "sidecar"}))
    driver.tick()
    assert driver.condition("Planned") == ("False", "InvalidTarget")
    assert "spec.targetRef.container" in driver.policy.status.message


def test_conditions_carry_the_generation() -> None:
    driver = Driver(make_policy(generation=7))
    driver.tick()
    assert {c.observed_generation for c in driver.policy.status.conditions} == {7}
    assert driver.policy.status.observed_generation == 7


def test_history_keeps_the_last_ten_decisions() -> None:
    driver = Driver(make_policy(**{"workload.typicalContextTokens": 2048}))
    for index in range(12):
        driver.edit({"workload.typicalContextTokens": 2048 + index + 1})
        driver.tick()  # restart
        driver.tick()  # plan: held
    assert len(driver.policy.status.history) == 10
    assert driver.policy.status.history[-1].generation == 13


def test_gate_output_parsing_takes_the_last_json_line() -> None:
    logs = 'starting\n{"verdict": "Pass", "recovery": 0.97}\n'
    report = read_report(JobView("j", succeeded=True, termination_message=logs).termination_message)
    assert (report.verdict, report.recovery) == (GateVerdict.PASS, 0.97)
    killed = read_report(JobView("j", failed=True, termination_message="Killed").termination_message)
    assert (killed.verdict, killed.reason) == (GateVerdict.INCONCLUSIVE, GateReason.REPORT_UNREADABLE)
    silent = read_report(JobView("j", failed=True).termination_message)
    assert (silent.verdict, silent.reason) == (GateVerdict.INCONCLUSIVE, GateReason.REPORT_MISSING)


def test_canary_pods_count_only_when_ready() -> None:
    driver = Driver(make_policy())
    driver.tick()
    driver.world.pods["x"] = PodView("x", None, ready=False)
    driver.tick()
    assert driver.phase == "CanaryStarting"
    assert driver.now > T0
    rolled = [a for a in driver.results[-1].actions if isinstance(a, Delete)]
    assert not rolled


def test_phase_deadlines_for_the_stuck_rollout_alert() -> None:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 120, "gates.accuracy.timeoutSeconds": 900}))
    driver.tick()
    assert phase_deadline(driver.policy) == driver.now + timedelta(seconds=120)
    driver.world.canary_up()
    driver.tick()
    assert phase_deadline(driver.policy) == driver.now + timedelta(seconds=900)
    driver.edit({"rollout.paused": True})
    driver.tick()
    assert phase_deadline(driver.policy) is None, "a paused rollout is not stuck"
    held = Driver(make_policy(**{"workload.typicalContextTokens": 2048}))
    held.tick()
    assert phase_deadline(held.policy) is None


def test_a_target_already_on_fp8_is_recorded_as_bf16_for_the_rollback() -> None:
    fp8_args = [*TARGET_ARGS, "--kv-cache-dtype", "fp8"]
    world = World(target=target_deployment(args=fp8_args))
    driver = Driver(make_policy(**{"gates.accuracy.enabled": False, "rollout.traffic": "Synthetic"}), world)
    run_to_canary(driver)
    driver.tick()
    driver.tick()
    assert driver.phase == "Promoted"
    assert driver.policy.status.previous_template.args == TARGET_ARGS
    driver.edit({"rollout.abort": True})
    driver.tick()  # restores the target
    driver.tick()  # observes it restored
    assert driver.phase == "RolledBack"
    assert container(world.target)["args"] == TARGET_ARGS and container(world.target)["image"] == TARGET_IMAGE


def test_a_preflight_that_never_runs_is_inconclusive_and_the_accuracy_gate_still_guards() -> None:
    driver = Driver(make_policy(**{"gates.gpuPreflight.enabled": True, "rollout.progressDeadlineSeconds": 60}))
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "GpuPreflight"
    driver.tick(61)
    assert driver.phase == "AccuracyGate"
    assert driver.condition("PreflightPassed") == ("Unknown", "PreflightTimedOut")
    assert "Job/llama-fp8-preflight-g1" in driver.world.deletes


def test_a_latency_probe_that_never_finishes_follows_on_inconclusive() -> None:
    driver = synthetic(**{"gates.latency.inconclusiveDeadlineSeconds": 100, "gates.latency.onInconclusive": "Rollback"})
    driver.tick(50)
    assert driver.phase == "LatencyAnalysis"
    driver.tick(51)
    assert driver.policy.status.decision.reason == "LatencyProbeTimeout"
    assert "Job/llama-fp8-latency-g1" in driver.world.deletes


def test_a_due_check_without_a_verdict_waits_a_poll_instead_of_spinning() -> None:
    driver = live()
    result = driver.tick(60, settle=False)
    assert driver.phase == "LatencyAnalysis"
    assert result.requeue_after == CONFIG.poll_seconds


def test_status_ratios_are_what_the_gate_compared() -> None:
    """ITL below vLLM's first bucket on both sides: status shows the resolved TTFT quantiles and the ITL mean, not the
    unresolved ITL quantiles (their 1.00 says nothing)."""
    bounds = (0.01, 0.025, float("inf"))

    def fast_decoder(role: str, itl_mean: float) -> SideMetrics:
        return SideMetrics(
            role,
            True,
            100,
            60.0,
            {0.5: 0.1, 0.95: 0.2},
            {0.5: 0.005, 0.95: 0.0095},
            itl_mean_seconds=itl_mean,
            itl_bucket_bounds=bounds,
        )

    config = LatencyGateConfig(ttft_max_ratio=1.2, itl_max_ratio=1.2, min_requests=1)
    breach = assess(config, fast_decoder("canary", 0.0078), fast_decoder("baseline", 0.006))
    driver = live()
    driver.tick(60, latency_verdict=breach)
    ratios = driver.policy.status.latency.last.ratios
    assert set(ratios) == {"ttft_p50", "ttft_p95", "itl_mean"}
    assert ratios["itl_mean"] == pytest.approx(1.3)


def test_the_latency_analysis_is_resumed_from_a_status_written_by_hand() -> None:
    status = {
        "startedAt": "2026-01-01T12:00:00Z",
        "checks": 2,
        "last": {"verdict": "NoData", "at": "2026-01-01T12:01:00Z"},
    }
    state = analysis_state(LatencyAnalysis.model_validate(status))
    assert state.started_at == T0 and state.last_check_at == T0 + timedelta(minutes=1)
    assert state.checks == 2 and state.passes == 0 and state.last_verdict == GateVerdict.NO_DATA


@pytest.mark.parametrize(
    ("status", "error"),
    [
        ({"startedAt": "yesterday"}, "Invalid isoformat string"),
        ({"startedAt": "2026-01-01T12:00:00Z", "last": {"verdict": "Maybe"}}, "Pass', 'Breach', 'NoData' or"),
    ],
)
def test_a_latency_analysis_status_that_is_no_state_is_rejected(status: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        analysis_state(LatencyAnalysis.model_validate(status))


def test_a_patched_image_other_than_the_targets_is_said_at_planning() -> None:
    """On Hopper the canary runs images.fp8Patched: when the target runs another image, the gates judge a vLLM change
    as well as FP8 KV, and a Warning says so; the same image says nothing."""
    other = Driver(make_policy())
    other.tick()
    assert other.reasons().count("CanaryImageDiffers") == 1
    warning = next(e for r in other.results for e in r.events if e.reason == "CanaryImageDiffers")
    assert warning.type == "Warning" and PATCHED_IMAGE in warning.message and TARGET_IMAGE in warning.message
    same = Driver(make_policy(**{"images.fp8Patched": TARGET_IMAGE}))
    same.tick()
    assert same.phase == "CanaryStarting" and "CanaryImageDiffers" not in same.reasons()
