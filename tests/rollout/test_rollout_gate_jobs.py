"""Gate Jobs a hardened cluster runs: Pod Security "restricted", the target's pull Secrets, resources from the
operator's settings; a gate pod that cannot start is said at once and fails well before the gate's timeout; a gate
that crashes says why."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kvpolicy.kube.observe import job_view
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.gates import JOB_GATES
from kvpolicy.rollout.gates.job import JobInputs
from kvpolicy.rollout.step_types import JobView, StepConfig, default_gate_resources
from kvpolicy.runtime.handlers import OperatorOptions
from kvpolicy_dev.devcluster.podsecurity import pod_template_specs, violations
from operator_helpers import CONFIG, Driver, make_policy, run_to_canary, target_deployment, to_accuracy_gate
from test_rollout_builders import FA3_PLAN, FP8_PLAN

POLICY = b.PolicyRef(name="llama-fp8", namespace="serving", uid="uid-1")
PULL_SECRETS = [{"name": "registry-credentials"}]


def restricted_target() -> dict[str, Any]:
    """A target that itself meets the restricted profile, with a private registry's pull Secret."""
    target = target_deployment()
    pod = target["spec"]["template"]["spec"]
    pod["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    pod["imagePullSecrets"] = copy.deepcopy(PULL_SECRETS)
    pod["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return target


def gate_jobs(config: StepConfig = CONFIG, target: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    spec = make_policy().spec
    jobs = {}
    for gate in JOB_GATES:
        pod_spec = (target or restricted_target())["spec"]["template"]["spec"]
        inputs = JobInputs(spec, config, f"llama-fp8-{gate.name}-g1", pod_spec, FA3_PLAN, "http://c", "http://b")
        jobs[gate.name] = b.gate_job(POLICY, gate.build(inputs))
    return jobs


def test_every_job_and_canary_the_builders_make_meets_pod_security_restricted() -> None:
    target = restricted_target()
    canary = b.canary_deployment(POLICY, "llama-fp8-canary-g1", target, make_policy().spec, FP8_PLAN)
    for obj in [*gate_jobs().values(), canary]:
        for pod_spec, pod_annotations in pod_template_specs(obj):
            assert violations("restricted", pod_spec, pod_annotations) == [], obj["metadata"]["name"]


def test_the_checker_refuses_what_restricted_refuses() -> None:
    bare = {"containers": [{"name": "gate", "image": "i"}]}
    found = violations("restricted", bare)
    assert [problem.split(" (")[0] for problem in found] == [
        "allowPrivilegeEscalation != false",
        "runAsNonRoot != true",
        "seccompProfile",
        "unrestricted capabilities",
    ]
    assert violations("baseline", bare) == []
    privileged = {"hostNetwork": True, "containers": [{"name": "c", "securityContext": {"privileged": True}}]}
    assert len(violations("baseline", privileged)) == 2


def test_gate_jobs_pull_with_the_targets_secrets_and_run_on_a_read_only_root() -> None:
    for job in gate_jobs().values():
        pod = job["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == PULL_SECRETS
        container = pod["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["volumeMounts"] == [{"name": "scratch", "mountPath": "/tmp"}]
    preflight = gate_jobs()["preflight"]["spec"]["template"]["spec"]
    assert preflight["nodeSelector"] == {"pool": "h200"}
    assert preflight["containers"][0]["env"] == [{"name": "HOME", "value": "/tmp"}], "Triton's cache is writable"


def test_gate_job_resources_come_from_the_operators_settings() -> None:
    small = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    config = StepConfig("gate:1", "probe:1", gate_resources=small, preflight_resources={"limits": {"memory": "8Gi"}})
    jobs = gate_jobs(config)
    assert jobs["accuracy"]["spec"]["template"]["spec"]["containers"][0]["resources"] == small
    assert jobs["preflight"]["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"nvidia.com/gpu": 1},
        "limits": {"memory": "8Gi", "nvidia.com/gpu": 1},
    }


def test_resources_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_GATE_RESOURCES", '{"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}')
    monkeypatch.setenv("KVPOLICY_PREFLIGHT_RESOURCES", '{"requests": {"memory": "4Gi"}}')
    config = OperatorOptions.from_env().step_config()
    assert config.gate_resources == {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}
    assert config.preflight_resources == {"requests": {"memory": "4Gi"}}
    monkeypatch.setenv("KVPOLICY_GATE_RESOURCES", "cpu=1")
    with pytest.raises(ValueError, match="KVPOLICY_GATE_RESOURCES is not JSON; give resources such as"):
        OperatorOptions.from_env()
    monkeypatch.setenv("KVPOLICY_GATE_RESOURCES", '{"cpu": "1"}')
    with pytest.raises(ValueError, match="is not requests/limits of quantities"):
        OperatorOptions.from_env()
    monkeypatch.delenv("KVPOLICY_GATE_RESOURCES")
    assert OperatorOptions.from_env().step_config().gate_resources == default_gate_resources()


def _pod(waiting: str | None = None, unschedulable: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending"}
    if waiting:
        status["containerStatuses"] = [{"state": {"waiting": {"reason": waiting, "message": "Back-off pulling"}}}]
    if unschedulable:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        ]
    return {"metadata": {"name": "gate-pod"}, "status": status}


def test_a_gate_pod_that_cannot_start_says_why() -> None:
    running = {"metadata": {"name": "j"}, "status": {}}
    assert (
        job_view(running, [_pod("ImagePullBackOff")]).not_starting
        == "pod gate-pod is ImagePullBackOff: Back-off pulling"
    )
    assert (
        job_view(running, [_pod(unschedulable="0/6 nodes")]).not_starting == "pod gate-pod is Unschedulable: 0/6 nodes"
    )
    assert job_view(running, [_pod("ContainerCreating")]).not_starting is None, "still starting"
    done = {"metadata": {"name": "j"}, "status": {"conditions": [{"type": "Failed", "status": "True"}]}}
    assert job_view(done, [_pod("ImagePullBackOff")]).not_starting is None


def test_an_unpullable_gate_image_is_said_at_once_and_fails_at_the_progress_deadline() -> None:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 300, "gates.accuracy.timeoutSeconds": 3600}))
    to_accuracy_gate(driver)
    job = "llama-fp8-accuracy-g1"
    why = 'pod llama-fp8-accuracy-g1-x is ImagePullBackOff: Back-off pulling image "private/kvpolicy:1"'
    driver.world.job_views[job] = JobView(job, not_starting=why)
    driver.tick(5)
    assert driver.condition("AccuracyGatePassed") == ("Unknown", "GatePodNotStarting")
    assert why in driver.policy.status.conditions[-1].message
    driver.tick(100)
    assert driver.reasons().count("GatePodNotStarting") == 1 and driver.phase == "AccuracyGate"
    driver.tick(200)
    assert driver.phase == "RollingBack", "at the progress deadline, not at the gate's 1-hour timeout"
    decision = driver.policy.status.decision
    assert decision.reason == "AccuracyGateError"
    assert "not started in 300 s" in decision.message and "ImagePullBackOff" in decision.message
    assert f"Job/{job}" in driver.world.deletes


def test_an_unschedulable_preflight_pod_is_inconclusive_and_the_accuracy_gate_still_guards() -> None:
    driver = Driver(make_policy(**{"gates.gpuPreflight.enabled": True, "rollout.progressDeadlineSeconds": 60}))
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "GpuPreflight"
    job = "llama-fp8-preflight-g1"
    driver.world.job_views[job] = JobView(job, not_starting="pod p is Unschedulable: 0/6 nodes: insufficient gpu")
    driver.tick(61)
    assert driver.phase == "AccuracyGate"
    message = next(c.message for c in driver.policy.status.conditions if c.type == "PreflightPassed")
    assert "Unschedulable: 0/6 nodes: insufficient gpu" in message


def test_a_crashed_gate_says_what_its_pod_said() -> None:
    driver = Driver(make_policy())
    to_accuracy_gate(driver)
    tail = "Traceback (most recent call last):\nConnectionRefusedError: [Errno 111] canary unreachable"
    driver.world.finish_job("accuracy", tail, exit_code=1, failure="BackoffLimitExceeded")
    driver.tick()
    message = driver.policy.status.decision.message
    assert "BackoffLimitExceeded, exit code 1" in message and "canary unreachable" in message
    assert "canary unreachable" in next(
        c.message for c in driver.policy.status.conditions if c.type == "AccuracyGatePassed"
    )


def test_the_scheduler_message_reaches_the_canary_ready_condition_at_the_deadline() -> None:
    driver = Driver(make_policy(**{"rollout.progressDeadlineSeconds": 60}))
    driver.tick()
    driver.world.canary_up(ready=False, unschedulable="0/6 nodes are available: insufficient nvidia.com/gpu")
    driver.tick()
    driver.tick(61)
    ready = next(c for c in driver.policy.status.conditions if c.type == "CanaryReady")
    assert ready.reason == "CapacityUnavailable"
    assert "0/6 nodes are available: insufficient nvidia.com/gpu" in ready.message
