"""The GPU preflight probes the attention the canary will run: FlashAttention-3 for a FLASH_ATTN plan; a plan whose
backend no probe backend measures skips the Job, says so, and the accuracy gate still guards."""

from __future__ import annotations

import pytest
from kvpolicy.planning.attention import BACKENDS, PROBE_BACKENDS
from kvpolicy.rollout.gates import preflight
from kvpolicy.rollout.gates.preflight import GPU_PREFLIGHT
from operator_helpers import Driver, World, gpu, make_policy, run_to_canary
from test_rollout_builders import FA3_PLAN, FP8_PLAN

PREFLIGHT = {"gates.gpuPreflight.enabled": True}


def test_the_preflight_command_names_the_probe_backend_and_the_gated_shape() -> None:
    spec = make_policy(**PREFLIGHT).spec
    assert preflight.command(spec, "vllm-fa3") == [
        "python", "-m", "kvkernels.probe", "--backend", "vllm-fa3",
        "--max-len", str(spec.accuracy_length), "--head-dim", "128", "--json",
    ]  # fmt: skip


def test_every_probe_backend_is_a_planned_attention_backend_and_one_the_probe_offers() -> None:
    from kvkernels.probe import BACKENDS as PROBE_CLI_BACKENDS

    assert set(PROBE_BACKENDS) <= set(BACKENDS)
    assert set(PROBE_BACKENDS.values()) <= set(PROBE_CLI_BACKENDS)


@pytest.mark.parametrize("plan", [FA3_PLAN, FP8_PLAN], ids=["FLASH_ATTN", "no backend named"])
def test_the_preflight_skips_only_plans_without_a_probe_backend(plan: object) -> None:
    skipped = GPU_PREFLIGHT.skip(plan)  # type: ignore[arg-type]
    assert (skipped is None) == (plan is FA3_PLAN)


def test_a_hopper_plan_probes_flash_attention_3() -> None:
    driver = Driver(make_policy(**PREFLIGHT))
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "GpuPreflight"
    assert driver.policy.status.plan is not None and driver.policy.status.plan.attention_backend == "FLASH_ATTN"
    command = driver.world.jobs["llama-fp8-preflight-g1"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--backend") + 1] == "vllm-fa3"


def test_an_ada_plan_is_not_probed_and_goes_on_to_the_accuracy_gate() -> None:
    driver = Driver(make_policy(**PREFLIGHT), World(gpu=gpu("L40S")))
    run_to_canary(driver)
    planned = driver.policy.status.plan
    assert planned is not None and planned.attention_backend == "TRITON_ATTN" and "GpuPreflight" in planned.gates
    driver.tick()
    assert driver.phase == "AccuracyGate"
    assert not any("-preflight-" in job for job in driver.world.jobs), "no probe Job for a backend it cannot measure"
    assert driver.condition("PreflightPassed") == ("Unknown", "PreflightNotProbed")
    events = [event for result in driver.results for event in result.events if event.reason == "PreflightNotProbed"]
    assert len(events) == 1 and events[0].type == "Warning"
    assert "TRITON_ATTN" in events[0].message and "relying on the accuracy gate" in events[0].message
    preflight = driver.policy.status.preflight
    assert preflight is not None and preflight.reason == "PreflightNotProbed" and preflight.job is None
