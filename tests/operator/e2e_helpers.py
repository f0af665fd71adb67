"""Objects and waits for the operator's end-to-end tests on the dev cluster."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from kopf.testing import KopfRunner
from kvpolicy.notify import metrics
from kvpolicy_dev.demo.traffic import Route, TrafficGenerator
from kvpolicy_dev.devcluster import POOL_LABEL, ThreadedDevCluster
from operator_helpers import set_paths

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
PATCHED_IMAGE = "vllm-fp8-twolevel:test"
TARGET_IMAGE = "vllm:0.12"
MODEL = "llama"
KVP = ("kvpolicy.dev/v1alpha1", "KVPolicy")
Obj = dict[str, Any]
# The operator's settings in the end-to-end tests: quick passes, and the images the dev cluster's kubelet knows.
OPERATOR_ENV = {
    "KVPOLICY_POLL_SECONDS": "0.2",
    "KVPOLICY_IDLE_SECONDS": "5",
    "KVPOLICY_GATE_IMAGE": "kvpolicy-operator:test",
    "KVPOLICY_PROBE_IMAGE": "vllm-kvkernels:test",
}
# The `operator` fixture: `with operator() as runner:` runs the operator under kopf.
OperatorFactory = Callable[[], AbstractContextManager[KopfRunner]]


# Long enough to be above the decode break-even, short enough for the gate to take seconds on a loaded machine.
CONTEXT = 16384
MODEL_LEN = 32768


def deployment(namespace: str, name: str, pool: str, vllm: Obj) -> Obj:
    """A one-replica Deployment on `pool` whose one container is `vllm` (with its port 8000)."""
    serving = {**vllm, "name": "vllm", "ports": [{"name": "http", "containerPort": 8000}]}
    pod = {"nodeSelector": {POOL_LABEL: pool}, "containers": [serving]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": pod}},
    }  # fmt: skip


def target(namespace: str, pool: str = "h200", name: str = "llama", max_model_len: int = MODEL_LEN) -> Obj:
    args = ["serve", MODEL, "--max-model-len", str(max_model_len)]
    return deployment(namespace, name, pool, {"image": TARGET_IMAGE, "args": args})


def vllm_serve_target(namespace: str, name: str, image: str, args: list[str], env: list[Obj] | None = None) -> Obj:
    """The BF16 Deployment on the h200 pool whose container runs `vllm serve ARGS` (real vLLM pods)."""
    return deployment(namespace, name, "h200", {"image": image, "command": ["vllm", "serve"], "args": args,
                                                "env": env or []})  # fmt: skip


def policy(namespace: str, name: str = "llama-fp8", **overrides: Any) -> Obj:
    spec: Obj = {
        "targetRef": {"name": "llama"},
        "model": {"servedModelName": MODEL, "headDim": 128, "numLayers": 32, "maxModelLen": MODEL_LEN},
        "workload": {"maxContextTokens": CONTEXT, "typicalContextTokens": CONTEXT},
        "images": {"fp8Patched": PATCHED_IMAGE},
        "gates": {"accuracy": {"maxSamples": 40}, "latency": {"enabled": False}},
        "rollout": {"progressDeadlineSeconds": 60, "bakeSeconds": 0},
    }
    set_paths(spec, overrides)
    return {"apiVersion": KVP[0], "kind": KVP[1], "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def wait_until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


async def until(check: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """`wait_until` for async tests: poll `check` without blocking the test's event loop."""
    for _ in range(int(within / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {within} s waiting for {what}")


def wait_phase(cluster: ThreadedDevCluster, namespace: str, phases: set[str], name: str = "llama-fp8") -> Obj:
    def reached() -> Obj | None:
        found = cluster.find(*KVP, name, namespace)
        return found if found and found.get("status", {}).get("phase") in phases else None

    def describe() -> str:
        found = cluster.find(*KVP, name, namespace) or {}
        return str(found.get("status", {}))[:3000]

    try:
        result: Obj = wait_until(reached, f"phase in {sorted(phases)}", timeout=90)
    except AssertionError as error:
        raise AssertionError(f"{error}\nstatus: {describe()}") from None
    return result


DECIDED = {"Promoted", "RolledBack", "HeldBF16"}


def wait_decided(cluster: ThreadedDevCluster, namespace: str) -> Obj:
    return wait_phase(cluster, namespace, DECIDED)


def decisions_counted(namespace: str, result: str, reason: str) -> float | None:
    """kvpolicy_decisions_total for the default policy, as the operator under kopf (in this process) counted it."""
    labels = {"namespace": namespace, "policy": "llama-fp8", "result": result, "reason": reason}
    return metrics.OPERATOR_METRICS.registry.get_sample_value("kvpolicy_decisions_total", labels)


def gate_jobs(cluster: ThreadedDevCluster, namespace: str) -> list[Obj]:
    return cluster.list("batch/v1", "Job", namespace, "kvpolicy.dev/role=gate")


def wait_decided_on_real_vllm(cluster: ThreadedDevCluster, namespace: str) -> Obj:
    """The policy once decided, waiting as long as real vLLM servers take to start on a loaded machine."""

    def decided() -> Obj | None:
        found = cluster.find(*KVP, "llama-fp8", namespace)
        return found if found and found.get("status", {}).get("phase") in DECIDED else None

    result: Obj = wait_until(decided, "a decision with real vLLM servers", timeout=450)
    return result


def tiny_model_policy(namespace: str, **overrides: Any) -> Obj:
    """A policy for the tiny random-weight Llama real vLLM serves (cpu_vllm_model): FP8 planned on its 4k context,
    no gate that needs a real model's answers, a deadline real vLLM's start-up fits in."""
    return policy(
        namespace,
        model={"servedModelName": "tiny", "headDim": 64, "numLayers": 2, "maxModelLen": 4096},
        workload={"maxContextTokens": 4096, "decodeBreakEvenTokens": 2048},
        gates={"accuracy": {"enabled": False}, "gpuPreflight": {"enabled": False}, "latency": {"enabled": False}},
        rollout={"bakeSeconds": 0, "progressDeadlineSeconds": 400},
        **overrides,
    )


def served_as_planned(status: Obj) -> None:
    """The canary configuration check passed on what the canary's vLLM itself reported: FP8 KV."""
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["CanaryConfigVerified"] == ("True", "ServedAsPlanned")
    assert status["canary"]["servedKvCacheDtype"] == "fp8", "what the canary's vLLM itself reports"


def start_and_reach_the_gate(cluster: ThreadedDevCluster, namespace: str) -> None:
    """Create the default policy and wait for its accuracy gate to be running."""
    cluster.create(policy(namespace))
    wait_phase(cluster, namespace, {"AccuracyGate"})


def event_reasons(cluster: ThreadedDevCluster, namespace: str, name: str = "llama-fp8") -> list[str]:
    events = cluster.list("v1", "Event", namespace)
    mine = [e for e in events if e.get("involvedObject", {}).get("name") == name]
    return [e["reason"] for e in sorted(mine, key=lambda e: e["metadata"].get("creationTimestamp", ""))]


def container(obj: Obj) -> Obj:
    """The first container of a Deployment's pod template, or of a Pod."""
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "Deployment" else obj["spec"]
    result: Obj = spec["containers"][0]
    return result


def ready_pods(cluster: ThreadedDevCluster, namespace: str, selector: str) -> list[Obj]:
    pods = cluster.list("v1", "Pod", namespace, selector)
    return [
        pod
        for pod in pods
        if not pod["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))
    ]


def kubectl_run(
    cluster: ThreadedDevCluster, *args: str, stdin: str = "", env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real kubectl against the dev cluster (a kubeconfig of its own; HOME beside it, so no user config)."""
    assert KUBECTL is not None, "kubectl missing: run `make tools`"
    environ = {**os.environ, **(env or {}), **cluster.environ(), "HOME": str(cluster.kubeconfig.parent)}
    return subprocess.run([KUBECTL, *args], input=stdin, env=environ, capture_output=True, text=True, timeout=120)


def kubectl(cluster: ThreadedDevCluster, *args: str, stdin: str = "", env: Mapping[str, str] | None = None) -> str:
    result = kubectl_run(cluster, *args, stdin=stdin, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


@contextlib.contextmanager
def in_background(run: Callable[[], Coroutine[Any, Any, None]]) -> Iterator[None]:
    """Run `run()` on an event loop of its own in a thread until the block ends (then it is cancelled)."""

    async def drive() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await run()

    loop = asyncio.new_event_loop()
    task = loop.create_task(drive())
    thread = threading.Thread(target=loop.run_until_complete, args=(task,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=30)
        loop.close()


@contextlib.contextmanager
def users(devcluster: ThreadedDevCluster, namespace: str) -> Iterator[TrafficGenerator]:
    """Steady requests to the pods behind the target's Service (app=llama), canary included once it joins."""
    route = Route(namespace, "llama", {"app": "llama"}, 8000, MODEL, CONTEXT // 4)
    generator = TrafficGenerator(
        [route], lambda: devcluster.list("v1", "Pod", namespace), requests_per_second=20, max_tokens=8
    )
    with in_background(generator.run):
        yield generator
