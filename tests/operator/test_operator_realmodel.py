"""The operator's rollout judged by the accuracy gate on a real model: the kubelet stand-in runs real vLLM serving
SmolLM2-135M-Instruct (real weights) for the target and the canary, and the gate Job runs `kvpolicy gate accuracy`
against the two pods at the workload's length, 8,000 tokens of the model's 8,192.

The canaries are made by their image's entrypoint (an `EntrypointQuirk`, as a wrapper script would): it adds vLLM's
own `--hf-overrides` that make every layer a sliding-window layer of W tokens. The plan keeps sliding-window layers in
BF16 (`kvCache.skipSlidingWindowLayers: Always`), so such a canary serves what the plan says (fp8, skip
sliding_window: the operator verifies it from the pod's /metrics) with every layer's KV in BF16:
- W = 8,192, the whole range: attention over the whole prompt, as the baseline's: an A/A, which must be Promoted;
- W = 2,048: needles more than 2,048 tokens before the question are out of reach: RolledBack to BF16.
The FP8-KV canary's decision on this model is tests/realmodel's (through the gate's command only: a third rollout
here would add minutes of CPU to every run).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import KVP, OperatorFactory, container, event_reasons, vllm_serve_target, wait_until
from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import AccuracyGate
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner
from kvpolicy_dev.devcluster.pytest_plugin import REAL_MODEL_GATE_RUNS
from kvpolicy_dev.devcluster.runners import EntrypointQuirk
from kvpolicy_dev.models import SMOLLM2_135M_INSTRUCT, sliding_window_args

pytestmark = [pytest.mark.realvllm, pytest.mark.realmodel]

MODEL = "smollm2"
NUM_LAYERS = SMOLLM2_135M_INSTRUCT.num_layers
MODEL_LEN = SMOLLM2_135M_INSTRUCT.max_model_len
WORKLOAD_LENGTH = 8000
# The gate's own cap (the CRD's default): this model finds about 2.8 of a haystack's 8 needles at 8k tokens, so an A/A
# takes about 24 samples (BENCHMARKS.md, "Real model").
SAMPLE_CAP = AccuracyGate().max_samples
TARGET_IMAGE = "vllm/vllm-openai:v0.32.0"
CANARY_IMAGE = "vllm-fp8-windowed:test"
# Two pods start together (30-120 s each on two cores, more under load); the gate takes 10-60 s a sample at 8k.
SERVER_START_SECONDS = 600.0
DECISION_SECONDS = SERVER_START_SECONDS + SAMPLE_CAP * 60.0
TERMINAL = ("Promoted", "RolledBack", "HeldBF16")


def windowed(model_dir: Path, window: int) -> RealVllmRunner:
    """The dev cluster's kubelet running real vLLM with the real model. Both images' entrypoints make every layer a
    sliding-window layer (so the plan keeps them all in BF16): the target's window spans the whole model length, the
    canary's is `window` tokens."""

    def quirk(tokens: int) -> EntrypointQuirk:
        return EntrypointQuirk(add=tuple(sliding_window_args(SMOLLM2_135M_INSTRUCT, tokens)))

    return RealVllmRunner(model_dir, quirks={TARGET_IMAGE: quirk(MODEL_LEN), CANARY_IMAGE: quirk(window)})


def target(namespace: str) -> dict[str, Any]:
    return vllm_serve_target(namespace, MODEL, TARGET_IMAGE, [MODEL, "--max-model-len", str(MODEL_LEN)])


def policy(namespace: str) -> dict[str, Any]:
    spec = {
        "targetRef": {"name": MODEL},
        # As the canary image serves it: every layer a sliding-window layer, kept in BF16 by the plan.
        "model": {
            "servedModelName": MODEL,
            "headDim": 64,
            "numLayers": NUM_LAYERS,
            "maxModelLen": MODEL_LEN,
            "slidingWindow": {"count": NUM_LAYERS, "windowTokens": MODEL_LEN},
        },
        "kvCache": {"skipSlidingWindowLayers": "Always"},
        "workload": {"maxContextTokens": WORKLOAD_LENGTH, "typicalContextTokens": WORKLOAD_LENGTH},
        "images": {"fp8Patched": CANARY_IMAGE},
        "gates": {
            "accuracy": {},
            "gpuPreflight": {"enabled": False},
            "latency": {"enabled": False},
        },
        "rollout": {"traffic": "Synthetic", "bakeSeconds": 0, "progressDeadlineSeconds": int(SERVER_START_SECONDS)},
    }
    return {"apiVersion": KVP[0], "kind": KVP[1], "metadata": {"name": "smollm2-fp8", "namespace": namespace},
            "spec": spec}  # fmt: skip


def roll_out(cluster: ThreadedDevCluster, namespace: str, operator: OperatorFactory, label: str) -> dict[str, Any]:
    """Create the target and the policy, run the operator until the rollout is decided; the final status."""
    cluster.create(target(namespace))
    started = time.monotonic()
    with operator():
        cluster.create(policy(namespace))

        def decided() -> dict[str, Any] | None:
            found = cluster.find(*KVP, "smollm2-fp8", namespace) or {}
            return found if found.get("status", {}).get("phase") in TERMINAL else None

        done = wait_until(decided, "a decision", DECISION_SECONDS)
    status: dict[str, Any] = done["status"]
    accuracy = status.get("accuracy") or {}
    REAL_MODEL_GATE_RUNS.append(
        f"{label} rollout through the operator: {status['phase']}, accuracy {accuracy.get('verdict')} after "
        f"{accuracy.get('samples')} prompts at {accuracy.get('lengthTokens')} tokens (canary "
        f"{accuracy.get('canaryScore')} vs baseline {accuracy.get('baselineScore')}), policy to decision "
        f"{time.monotonic() - started:.0f} s"
    )
    return status


def config_verified(status: dict[str, Any]) -> dict[str, Any]:
    verified: dict[str, Any] = {c["type"]: c for c in status["conditions"]}["CanaryConfigVerified"]
    return verified


@pytest.mark.longgate  # ~24 samples of 8 requests at 8k on SmolLM2: `make test-realmodel`
def test_an_aa_canary_on_the_real_model_is_promoted(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, real_model: Path
) -> None:
    devcluster.set_runner(windowed(real_model, MODEL_LEN))
    status = roll_out(devcluster, devcluster_namespace, operator, "A/A")
    assert status["phase"] == "Promoted", status
    assert (config_verified(status)["status"], config_verified(status)["reason"]) == ("True", "ServedAsPlanned")
    accuracy = status["accuracy"]
    assert (accuracy["verdict"], accuracy["lengthTokens"]) == ("Pass", WORKLOAD_LENGTH), accuracy
    assert accuracy["samples"] <= SAMPLE_CAP and accuracy["baselineScore"] > 0, accuracy
    promoted = container(devcluster.get("apps/v1", "Deployment", MODEL, devcluster_namespace))
    assert promoted["image"] == CANARY_IMAGE, promoted
    assert Reason.ACCURACY_GATE_PASSED in event_reasons(devcluster, devcluster_namespace, "smollm2-fp8")


def test_a_canary_blind_beyond_2k_tokens_is_rolled_back_to_bf16(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, real_model: Path
) -> None:
    """The window is part of vLLM's cache configuration, so the full parity check on the ready canary names it
    before the accuracy gate runs (the gate's own verdict on this canary: tests/realmodel, `make test-realmodel`)."""
    devcluster.set_runner(windowed(real_model, 2048))
    status = roll_out(devcluster, devcluster_namespace, operator, "broken")
    assert (status["phase"], status["decision"]["reason"]) == ("RolledBack", DecisionReason.CANARY_CONFIG_MISMATCH)
    verified = config_verified(status)
    assert verified["status"] == "False" and "sliding_window" in verified["message"], verified
    restored = container(devcluster.get("apps/v1", "Deployment", MODEL, devcluster_namespace))
    assert (restored["image"], restored["args"]) == (TARGET_IMAGE, [MODEL, "--max-model-len", str(MODEL_LEN)])
