"""Arguments real vLLM refuses are refused here too: the CPU entrypoint checks every `vllm serve` argument with vLLM's
own parser, and GPU-kernel flags with vLLM's own validator before leaving them out, so a plan with a bad argument
never gets a ready canary (the rollout then fails, as tests/operator/test_operator_realvllm.py would)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from kvpolicy.api.v1alpha1 import KVCacheDtype, KVPolicySpec, Plan
from kvpolicy.rollout import builders
from kvpolicy_dev.devcluster import POOL_LABEL, ThreadedDevCluster
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner, entrypoint_argv

pytestmark = pytest.mark.realvllm

EXIT_REFUSED = 2


def test_the_entrypoint_refuses_what_vllm_serve_refuses(cpu_vllm_model: Path) -> None:
    argv = entrypoint_argv(["tiny", "--kv-cache-dtype", "fp9"], cpu_vllm_model, "127.0.0.1", 9)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    assert "usage: vllm serve" in done.stderr
    assert "argument --kv-cache-dtype: invalid choice: 'fp9'" in done.stderr


def test_a_canary_whose_plan_vllm_refuses_never_becomes_ready(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, cpu_vllm_model: Path
) -> None:
    ns = devcluster_namespace
    devcluster.set_runner(RealVllmRunner(cpu_vllm_model))
    container = {"name": "vllm", "image": "vllm:test", "command": ["vllm", "serve"], "args": ["tiny"]}
    target = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "tiny", "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": "tiny"}},
            "template": {
                "metadata": {"labels": {"app": "tiny"}},
                "spec": {"nodeSelector": {POOL_LABEL: "h200"}, "containers": [container]},
            },
        },
    }
    spec = KVPolicySpec.model_validate(
        {
            "targetRef": {"name": "tiny"},
            "model": {"servedModelName": "tiny", "headDim": 64, "numLayers": 2, "maxModelLen": 4096},
            "workload": {"maxContextTokens": 4096},
        }
    )
    # A GPU-kernel flag with a name vLLM does not know: vLLM's parser takes any string, its validator does not.
    plan = Plan(
        kv_cache_dtype=KVCacheDtype.FP8,
        vllm_kv_cache_dtype="fp8",
        attention_backend="FLASH_ATTN3",
        extra_args=["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN3"],
    )
    policy = builders.PolicyRef("tiny-fp8", ns, "00000000-0000-0000-0000-000000000000")
    devcluster.create(builders.canary_deployment(policy, "tiny-fp8-canary-g1", target, spec, plan))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pods = devcluster.list("v1", "Pod", ns, "kvpolicy.dev/role=canary")
        statuses = [s for pod in pods for s in pod.get("status", {}).get("containerStatuses", [])]
        ended = [s["lastState"]["terminated"] for s in statuses if "terminated" in s.get("lastState", {})]
        if ended:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the canary's vLLM did not exit")
    assert not statuses[0]["ready"] and statuses[0]["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert ended[0]["exitCode"] == EXIT_REFUSED
    log = devcluster.call(devcluster.cluster.kubelet.read_log, ns, pods[0]["metadata"]["name"])
    assert "argument --attention-backend: 'FLASH_ATTN3' is not an attention backend vLLM knows" in log, log[-3000:]
