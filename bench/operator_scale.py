"""Operator scale: N KVPolicies on the emulated API server, the operator (`kvpolicy run`) in its own process.

Two workloads:
- `rollout`: each policy targets its own one-replica Deployment on a Hopper or a Blackwell pool and plans FP8, so it
  goes through the whole rollout: canary, accuracy gate Job, latency probe Job (Synthetic traffic), promotion. vLLM
  containers run no process (ready at once) and gate Jobs run an instant fake that writes a Pass verdict.
- `hold`: each policy plans BF16 (typical context below the break-even) and is decided in one pass; the policies share
  20 target Deployments without pods. This one measures the operator's per-policy cost at 1,000 policies, where the
  emulated cluster (one Python process reconciling every object on every change) could not run 1,000 canaries.
Reported: seconds from the creation of the first policy until every policy is decided, the operator's peak RSS
(VmHWM) and CPU seconds, and the API requests the server answered meanwhile (all, and how many were lists).

    .venv/bin/python bench/operator_scale.py --mode rollout --policies 20 100
    .venv/bin/python bench/operator_scale.py --mode hold --policies 100 1000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvpolicy.api import crd
from kvpolicy_dev.devcluster import (
    CPU_POOL,
    POOL_LABEL,
    NodePool,
    NoProcessRunner,
    ThreadedDevCluster,
    apiserver,
    kubelet,
)

NAMESPACE = "bench"
PATCHED_IMAGE = "vllm-fp8-twolevel:bench"
DECIDED = {"Promoted", "RolledBack", "HeldBF16"}
FAKE_VERDICT = '{"gate":"bench","verdict":"Pass","reason":"Fake","message":"instant fake","recovery":1.0}'


def fake_job_argv(container: Mapping[str, Any]) -> list[str]:
    """Every gate Job passes at once (the bench measures the operator, not the gates)."""
    return ["sh", "-c", f"printf '%s' '{FAKE_VERDICT}' > \"${kubelet.TERMINATION_LOG_ENV}\""]


def target(index: int, replicas: int) -> dict[str, Any]:
    name = f"model-{index}"
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {POOL_LABEL: "h200" if index % 2 else "b200"},
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm:0.12",
                            "args": ["serve", "llama", "--max-model-len", "131072"],
                            "ports": [{"name": "http", "containerPort": 8000}],
                        }
                    ],
                },
            },
        },
    }


HOLD_TARGETS = 20


def policy(index: int, hold: bool) -> dict[str, Any]:
    target_index = index % HOLD_TARGETS if hold else index
    return {
        "apiVersion": "kvpolicy.dev/v1alpha1",
        "kind": "KVPolicy",
        "metadata": {"name": f"model-{index}", "namespace": NAMESPACE},
        "spec": {
            "targetRef": {"name": f"model-{target_index}"},
            "model": {"servedModelName": "llama", "headDim": 128, "numLayers": 32, "maxModelLen": 131072},
            "workload": {"maxContextTokens": 131072, "typicalContextTokens": 2048 if hold else 65536},
            "images": {"fp8Patched": PATCHED_IMAGE},
            "rollout": {"traffic": "Synthetic", "bakeSeconds": 0, "progressDeadlineSeconds": 3600},
        },
    }


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in KiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests_by_verb(cluster: ThreadedDevCluster, since: int) -> dict[str, int]:
    """The API requests answered since request number `since`: all of them, and the lists (watches not counted)."""
    requests = cluster.call(lambda: list(cluster.cluster.api))[since:]
    lists = sum(1 for r in requests if r.method.value == "GET" and r.name is None and r.params.get("watch") is None)
    return {"all": len(requests), "lists": lists}


def run_once(mode: str, count: int, poll_seconds: float, give_up_after: float) -> dict[str, Any]:
    hold = mode == "hold"
    apiserver.REQUEST_HISTORY_LIMIT = 10_000_000  # keep every request of the run, to count them
    pools = [NodePool("h200", "NVIDIA-H200"), NodePool("b200", "NVIDIA-B200"), NodePool(CPU_POOL, None)]
    original_job_argv = kubelet.job_argv
    kubelet.job_argv = fake_job_argv
    try:
        with ThreadedDevCluster(pools=pools, runner=NoProcessRunner(), namespaces=(NAMESPACE,)) as cluster:
            cluster.apply(crd.crd_object())
            for index in range(min(count, HOLD_TARGETS) if hold else count):
                cluster.create(target(index, replicas=0 if hold else 1))
            env = {
                **os.environ,
                **cluster.environ(),
                "KVPOLICY_POLL_SECONDS": str(poll_seconds),
                "KVPOLICY_IDLE_SECONDS": "60",
            }
            with tempfile.TemporaryFile() as log:
                argv = [sys.executable, "-m", "kvpolicy", "run", "--namespace", NAMESPACE,
                        "--liveness-port", "0", "--metrics-port", "0"]  # fmt: skip
                operator = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
                try:
                    time.sleep(2.0)  # kopf's start-up is not part of the rollout time
                    first_request = cluster.call(lambda: len(list(cluster.cluster.api)))
                    started = time.monotonic()
                    for index in range(count):
                        cluster.create(policy(index, hold))
                    rss_samples: list[int] = []
                    decided = 0
                    phases: dict[str, int] = {}
                    while time.monotonic() - started < give_up_after:
                        objects = cluster.list("kvpolicy.dev/v1alpha1", "KVPolicy", NAMESPACE)
                        phases = {}
                        for obj in objects:
                            phase = obj.get("status", {}).get("phase", "None")
                            phases[phase] = phases.get(phase, 0) + 1
                        decided = sum(n for phase, n in phases.items() if phase in DECIDED)
                        rss_samples.append(proc_status(operator.pid)["VmRSS"])
                        if decided == count:
                            break
                        time.sleep(0.5)
                    elapsed = time.monotonic() - started
                    requests = requests_by_verb(cluster, first_request)
                    status = proc_status(operator.pid)
                    cpu = cpu_seconds(operator.pid)
                finally:
                    operator.terminate()
                    try:
                        operator.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        operator.kill()
                        operator.wait()
    finally:
        kubelet.job_argv = original_job_argv
    return {
        "mode": mode,
        "policies": count,
        "decided": decided,
        "phases": phases,
        "seconds_to_all_decided": round(elapsed, 1) if decided == count else None,
        "operator_peak_rss_mib": round(status["VmHWM"] / 1024, 1),
        "operator_final_rss_mib": round(status["VmRSS"] / 1024, 1),
        "operator_cpu_seconds": round(cpu, 1),
        "api_requests": requests["all"],
        "api_lists": requests["lists"],
        "poll_seconds": poll_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["rollout", "hold"], default="rollout")
    parser.add_argument("--policies", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--poll-seconds", type=float, default=5.0, help="KVPOLICY_POLL_SECONDS of the operator")
    parser.add_argument("--give-up-after", type=float, default=1800.0)
    args = parser.parse_args(argv)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"# {datetime.now(UTC):%Y-%m-%d} on {machine}")
    header = "| workload | policies | decided | time to all decided (s) | operator peak RSS (MiB) | operator CPU (s) |"
    print(f"{header} API requests (lists) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for count in args.policies:
        result = run_once(args.mode, count, args.poll_seconds, args.give_up_after)
        print(json.dumps(result), file=sys.stderr)
        seconds = result["seconds_to_all_decided"]
        print(
            f"| {args.mode} | {count} | {result['decided']} | {seconds if seconds is not None else 'not all'} | "
            f"{result['operator_peak_rss_mib']} | {result['operator_cpu_seconds']} | "
            f"{result['api_requests']} ({result['api_lists']}) |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
