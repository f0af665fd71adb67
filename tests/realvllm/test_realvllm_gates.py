"""The gate Jobs the operator builds, run by the dev cluster's kubelet against the two real vLLM servers (FP8 canary,
BF16 baseline): the Job spec, its command and the verdict in its termination message are the real ones."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kvpolicy.api.v1alpha1 import KVPolicySpec
from kvpolicy.gate_programs.latency import Fit
from kvpolicy.rollout import builders
from kvpolicy.rollout.gates import accuracy as accuracy_gate
from kvpolicy.rollout.gates import latency_probe as latency_probe_gate
from kvpolicy.rollout.step_types import default_gate_resources
from kvpolicy_dev.devcluster import ThreadedDevCluster
from realvllm_helpers import MAX_MODEL_LEN, SERVED_MODEL, RealPair

# The order of Fit's fields, as the gate's report names them (Fit.as_json).
FIT_KEYS = ("itlSlopeMsPerToken", "itlInterceptMs", "ttftQuadMsPerToken2", "ttftLinearMsPerToken", "ttftConstMs")

pytestmark = pytest.mark.realvllm

GATE_LENGTH = 2048
JOB_TIMEOUT_SECONDS = 300
# `kvpolicy gate` exits 0 on a pass, 1 on a fail or breach, 2 when inconclusive.
EXIT_CODES = {"Pass": 0, "Fail": 1, "Breach": 1, "Inconclusive": 2}


def spec(**gates: Any) -> KVPolicySpec:
    return KVPolicySpec.model_validate(
        {
            "targetRef": {"name": "tiny"},
            "model": {"servedModelName": SERVED_MODEL, "headDim": 64, "numLayers": 2, "maxModelLen": MAX_MODEL_LEN},
            "workload": {"maxContextTokens": GATE_LENGTH},
            "gates": gates,
        }
    )


def run_gate_job(
    cluster: ThreadedDevCluster, namespace: str, name: str, command: list[str]
) -> tuple[dict[str, Any], str]:
    """Create the gate Job as the operator would and wait for it to finish: its JSON verdict (the termination
    message, as the operator reads it) and its log."""
    owner = builders.PolicyRef("tiny-fp8", namespace, "00000000-0000-0000-0000-000000000000")
    job = builders.GateJob(
        name=name,
        role=builders.ROLE_GATE,
        image="kvpolicy-operator:test",
        command=command,
        timeout_seconds=JOB_TIMEOUT_SECONDS,
        resources=default_gate_resources(),
        pod_placement={},
    )
    cluster.create(builders.gate_job(owner, job))
    deadline = time.monotonic() + JOB_TIMEOUT_SECONDS + 30
    while time.monotonic() < deadline:
        pods = cluster.list("v1", "Pod", namespace, f"job-name={name}")
        states = [p.get("status", {}).get("containerStatuses", [{}])[0].get("state", {}) for p in pods]
        finished = [state["terminated"] for state in states if "terminated" in state]
        if finished:
            pod = pods[0]["metadata"]["name"]
            log = cluster.call(cluster.cluster.kubelet.read_log, namespace, pod)
            report = json.loads(finished[0]["message"])
            assert finished[0]["exitCode"] == EXIT_CODES[report["verdict"]], f"{finished[0]}\n{log}"
            return report, log
        time.sleep(0.5)
    raise AssertionError(f"gate Job {name} did not finish in {JOB_TIMEOUT_SECONDS} s")


def test_latency_gate_job_fits_real_vllm_and_breaches_impossible_limits(
    real_vllm: RealPair, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    # Limits no canary can meet (half the baseline's latency): a decision on real measurements, whatever they are.
    policy = spec(latency={"ttftMaxRatio": "0.5", "itlMaxRatio": "0.5"})
    command = latency_probe_gate.command(policy, real_vllm.fp8.url, real_vllm.bf16.url)
    report, _ = run_gate_job(devcluster, devcluster_namespace, "tiny-fp8-latency-g1", command)
    assert (report["verdict"], report["reason"]) == ("Breach", "LatencyAboveLimit"), report
    for side in ("canary", "baseline"):
        fit = report[side]
        curve = Fit(*(fit[key] for key in FIT_KEYS))
        # The whole fitted curves: noisy CPU timings can make one coefficient negative (a run fitted TTFT's linear
        # term at -0.014 ms/token with its quadratic term at 2.8e-5), never the latency they predict.
        assert curve.itl_ms(GATE_LENGTH) > 0 and curve.ttft_ms(GATE_LENGTH) > 0, fit
    (at_length,) = report["atWorkloadLengths"]
    assert at_length["length"] == GATE_LENGTH and max(at_length["ttftRatio"], at_length["itlRatio"]) > 0.5, report


def test_accuracy_gate_job_decides_by_its_rules_on_real_vllm(
    real_vllm: RealPair, devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    """With random weights neither server finds a needle: a baseline scoring 0 cannot judge a canary, so the gate
    ends Inconclusive (BaselineTooWeak), never a pass or a fail, with both scores 0 (before prompts were sized in
    token space it stopped at PromptSizing). 16 wrong needles show the baseline below the floor: it stops after the
    gate's minimum of 2 samples, before its cap of 3."""
    policy = spec(accuracy={"maxSamples": 3, "lengthTokens": GATE_LENGTH})
    command = accuracy_gate.command(policy, real_vllm.fp8.url, real_vllm.bf16.url)
    report, _ = run_gate_job(devcluster, devcluster_namespace, "tiny-fp8-accuracy-g1", command)
    assert (report["verdict"], report["reason"]) == ("Inconclusive", "BaselineTooWeak"), report
    assert report["samples"] == 2 and report["lengthTokens"] == GATE_LENGTH, report
    assert (report["canaryScore"], report["baselineScore"]) == (0.0, 0.0), report
