"""The operator's rollout with real vLLM in the pods: the kubelet stand-in runs vLLM's CPU build (a tiny random-weight
Llama) for the target, the canary and the promoted target, with exactly the arguments in their pod specs.

What is checked is what vLLM itself reports: the arguments each pod's entrypoint received, and the KV cache each
server says it runs (vllm:cache_config_info). GPU-kernel flags are checked with vLLM's parser and left out on CPU.
Accuracy is not gated here (random weights find no needle; tests/realvllm has the accuracy gate's own test), so the
decision rests on the latency probe Job, run against the two real servers with limits CPU noise cannot break.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
from e2e_helpers import KVP, OperatorFactory, container, event_reasons, wait_until
from kvpolicy_dev.devcluster import POOL_LABEL, ThreadedDevCluster
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner
from kvpolicy_dev.devcluster.pytest_plugin import REAL_VLLM_STARTUP_SECONDS
from kvpolicy_dev.devcluster.runners import EntrypointQuirk
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.realvllm

MODEL = "tiny"
MODEL_LEN = 4096
TARGET_IMAGE = "vllm/vllm-openai:v0.32.0"
PATCHED_IMAGE = "vllm-fp8-twolevel:test"
PLAN_ARGS = ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window", "--attention-backend",
             "FLASH_ATTN"]  # fmt: skip
# Real vLLM starts in tens of seconds on two cores, more when the machine is busy.
SERVER_START_SECONDS = 400.0


def target(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": MODEL, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": MODEL}},
            "template": {
                "metadata": {"labels": {"app": MODEL}},
                "spec": {
                    "nodeSelector": {POOL_LABEL: "h200"},
                    "containers": [
                        {
                            "name": "vllm",
                            "image": TARGET_IMAGE,
                            "command": ["vllm", "serve"],
                            "args": [MODEL, "--max-model-len", str(MODEL_LEN)],
                            "ports": [{"name": "http", "containerPort": 8000}],
                        }
                    ],
                },
            },
        },
    }


def policy(namespace: str) -> dict[str, Any]:
    spec = {
        "targetRef": {"name": MODEL},
        # The spec describes a model with one 128-token sliding-window layer of two, so the plan keeps it in BF16;
        # vLLM accepts `--kv-cache-dtype-skip-layers sliding_window` for the tiny Llama too (it has none to skip).
        "model": {
            "servedModelName": MODEL,
            "headDim": 64,
            "numLayers": 2,
            "maxModelLen": MODEL_LEN,
            "slidingWindow": {"count": 1, "windowTokens": 128},
        },
        "workload": {"maxContextTokens": MODEL_LEN, "decodeBreakEvenTokens": 2048},
        "images": {"fp8Patched": PATCHED_IMAGE},
        "gates": {
            "accuracy": {"enabled": False},
            "gpuPreflight": {"enabled": False},
            "latency": {"ttftMaxRatio": "100", "itlMaxRatio": "100"},
        },
        "rollout": {"traffic": "Synthetic", "bakeSeconds": 0, "progressDeadlineSeconds": int(SERVER_START_SECONDS)},
    }
    return {
        "apiVersion": KVP[0],
        "kind": KVP[1],
        "metadata": {"name": "tiny-fp8", "namespace": namespace},
        "spec": spec,
    }


def ready_pod(
    cluster: ThreadedDevCluster, namespace: str, selector: str, where: Callable[[dict[str, Any]], bool]
) -> dict[str, Any] | None:
    """The first Ready pod matching `selector` and `where`, or None."""
    for pod in cluster.list("v1", "Pod", namespace, selector):
        conditions = pod.get("status", {}).get("conditions", [])
        if where(pod) and any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            return pod
    return None


def served_cache(pod: dict[str, Any]) -> tuple[str, str]:
    """(cache_dtype, kv_cache_dtype_skip_layers) from the pod's own vllm:cache_config_info."""
    with urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    (sample,) = families["vllm:cache_config_info"].samples
    return sample.labels["cache_dtype"], sample.labels["kv_cache_dtype_skip_layers"]


def pod_log(cluster: ThreadedDevCluster, namespace: str, pod: dict[str, Any]) -> str:
    return cluster.call(cluster.cluster.kubelet.read_log, namespace, pod["metadata"]["name"])


def wait_ready_pod(cluster: ThreadedDevCluster, namespace: str, selector: str, name: str,
                   where: Callable[[dict[str, Any]], bool] = lambda pod: True) -> dict[str, Any]:  # fmt: skip
    started = time.monotonic()
    pod = wait_until(lambda: ready_pod(cluster, namespace, selector, where), name, SERVER_START_SECONDS)
    REAL_VLLM_STARTUP_SECONDS[name] = time.monotonic() - started
    return pod


def test_rollout_with_real_vllm_runs_the_plans_arguments_and_promotes(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, cpu_vllm_model: Path
) -> None:
    ns = devcluster_namespace
    devcluster.set_runner(RealVllmRunner(cpu_vllm_model))
    devcluster.create(target(ns))
    bf16_target = wait_ready_pod(devcluster, ns, "app=tiny", "rollout target (BF16)")
    assert served_cache(bf16_target) == ("auto", "[]")
    with operator():
        devcluster.create(policy(ns))
        canary = wait_ready_pod(devcluster, ns, "kvpolicy.dev/role=canary", "rollout canary (FP8)")
        canary_spec = container(canary)
        assert canary_spec["image"] == PATCHED_IMAGE
        assert canary_spec["args"] == [MODEL, "--max-model-len", str(MODEL_LEN), *PLAN_ARGS]
        log = pod_log(devcluster, ns, canary)
        assert f"the container runs: vllm serve {' '.join(canary_spec['args'])}\n" in log, log[-3000:]
        assert "--attention-backend FLASH_ATTN: accepted by vLLM's parser and validator; left out on CPU" in log
        assert served_cache(canary) == ("fp8", "['sliding_window']")

        def decided() -> dict[str, Any] | None:
            found = devcluster.find(*KVP, "tiny-fp8", ns) or {}
            return found if found.get("status", {}).get("phase") in ("Promoted", "RolledBack", "HeldBF16") else None

        done = wait_until(decided, "a decision", SERVER_START_SECONDS)
        assert done["status"]["phase"] == "Promoted", done["status"]
        # The operator read the same from the canary's /metrics before any gate (direct scrape provider).
        verified = {c["type"]: c for c in done["status"]["conditions"]}["CanaryConfigVerified"]
        assert (verified["status"], verified["reason"]) == ("True", "ServedAsPlanned"), verified
        assert done["status"]["canary"]["servedKvCacheDtype"] == "fp8"
        assert done["status"]["canary"]["servedSkipLayers"] == ["sliding_window"]
        assert done["status"]["latency"]["probe"]["verdict"] == "Pass", done["status"]["latency"]
        promoted = container(devcluster.get("apps/v1", "Deployment", MODEL, ns))
        assert promoted["image"] == PATCHED_IMAGE and promoted["args"][-len(PLAN_ARGS) :] == PLAN_ARGS
        new_target = wait_ready_pod(devcluster, ns, "app=tiny,!kvpolicy.dev/role", "promoted target (FP8)",
                                    lambda pod: container(pod)["image"] == PATCHED_IMAGE)  # fmt: skip
        assert served_cache(new_target) == ("fp8", "['sliding_window']")
    assert "LatencyAnalysisStarted" in event_reasons(devcluster, ns, "tiny-fp8")


def test_a_canary_whose_entrypoint_drops_the_kv_dtype_is_rolled_back_with_planned_and_served(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, cpu_vllm_model: Path
) -> None:
    ns = devcluster_namespace
    lossy = {PATCHED_IMAGE: EntrypointQuirk(drop=("--kv-cache-dtype",))}
    devcluster.set_runner(RealVllmRunner(cpu_vllm_model, quirks=lossy))
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns))  # the target and the canary start together

        def decided() -> dict[str, Any] | None:
            found = devcluster.find(*KVP, "tiny-fp8", ns) or {}
            return found if found.get("status", {}).get("phase") in ("Promoted", "RolledBack", "HeldBF16") else None

        done = wait_until(decided, "a decision", 2 * SERVER_START_SECONDS)
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    decision = status["decision"]
    assert decision["reason"] == "CanaryConfigMismatch", decision
    assert "planned KV cache dtype fp8, skip layers [sliding_window]" in decision["message"], decision
    assert "serves KV cache dtype auto, skip layers [sliding_window]" in decision["message"], decision
    verified = {c["type"]: c for c in status["conditions"]}["CanaryConfigVerified"]
    assert (verified["status"], verified["reason"]) == ("False", "CanaryConfigMismatch"), verified
    assert "latency" not in status or not (status["latency"] or {}).get("probe"), "no gate ran"
