"""Operator scale (issue 28 item 4): the operator's memory and decision latency with N KVPolicies.

The emulated API server and kubelet (`kvpolicy_dev.devcluster`) run in this process, the operator (`kvpolicy run`) in
its own, as in a cluster. Each policy has a target Deployment of its own (no replicas: the kubelet has nothing to
run) on a Hopper or a Blackwell pool, and plans BF16 (typical context below the decode break-even), so one pass
decides it: what is measured is the operator's per-policy cost, not a rollout's. For each N, in this order:

1. cold start: N policies exist, then the operator starts; its peak RSS until every policy has its first status.
2. steady: the operator's RSS once every policy is decided (and `--settle` seconds later).
3. delete all N; the RSS once they are gone (what a policy leaves behind).
4. create N again at once while the operator runs; decision latency = the time from a policy's creation to the
   operator's first status write for it (the API server's write log), p50 / p90 / p99 / max; peak RSS.

Policies held by `--waiting` (a fraction) name a target that does not exist: they stay in Planning and are looked at
again every poll period, the case whose passes read ownership (issue 28: 200 of them cost 374 MiB at cold start).

    .venv/bin/python bench/operator_scale.py --policies 200 1000
    .venv/bin/python bench/operator_scale.py --policies 5000 --settle 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import yaml
from kvpolicy.api import crd
from kvpolicy_dev.devcluster import CPU_POOL, POOL_LABEL, NodePool, NoProcessRunner, ThreadedDevCluster

NAMESPACE = "bench"
KVP = ("kvpolicy.dev/v1alpha1", "KVPolicy")
OPERATOR = "kvpolicy-operator"  # the operator's bearer token: the write log's user
LEASE = "kvpolicy-operator-leader"
KVP_PLURAL = "kvpolicies"


def target(index: int) -> dict[str, Any]:
    name = f"model-{index}"
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicas": 0,
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


def policy(index: int, waiting: bool) -> dict[str, Any]:
    return {
        "apiVersion": KVP[0],
        "kind": KVP[1],
        "metadata": {"name": f"model-{index}", "namespace": NAMESPACE},
        "spec": {
            "targetRef": {"name": f"absent-{index}" if waiting else f"model-{index}"},
            "model": {"servedModelName": "llama", "headDim": 128, "numLayers": 32, "maxModelLen": 131072},
            "workload": {"maxContextTokens": 131072, "typicalContextTokens": 2048},
        },
    }


def rss_kib(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            return int(rest.split()[0])
    raise KeyError(key)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class RssSampler:
    """The operator's VmRSS every 0.2 s in a thread; `peak()` since the last `reset()`."""

    pid: int
    _peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._peak = max(self._peak, rss_kib(self.pid))
            except (OSError, KeyError):
                return

    def reset(self) -> None:
        self._peak = rss_kib(self.pid)

    def peak(self) -> float:
        return round(max(self._peak, rss_kib(self.pid)) / 1024, 1)

    def stop(self) -> None:
        self._stop.set()


def mib(pid: int) -> float:
    return round(rss_kib(pid) / 1024, 1)


def first_status_writes(cluster: ThreadedDevCluster, since: int) -> dict[str, float]:
    """Policy name -> time of the operator's first successful status write after write number `since`."""
    firsts: dict[str, float] = {}
    for write in cluster.writes()[since:]:
        path = write.path
        if (
            path is not None
            and write.user == OPERATOR
            and path.plural == "kvpolicies"
            and path.subresource == "status"
            and write.code < 300
            and path.name is not None
        ):
            firsts.setdefault(path.name, write.time)
    return firsts


def wait_until(what: str, done: Callable[[], bool], give_up_after: float, every: float = 1.0) -> float:
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > give_up_after:
            raise TimeoutError(f"{what}: not after {give_up_after:.0f} s")
        time.sleep(every)
    return time.monotonic() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


@contextmanager
def operator_process(
    cluster: ThreadedDevCluster,
    poll_seconds: float,
    log: IO[bytes],
    profile: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> Iterator[int]:
    env = {**os.environ, **cluster.environ(), "KVPOLICY_POLL_SECONDS": str(poll_seconds), **(extra_env or {})}
    config = yaml.safe_load(Path(env["KUBECONFIG"]).read_text())
    config["users"][0]["user"]["token"] = OPERATOR  # the API server's write log tells the operator's writes apart
    with tempfile.NamedTemporaryFile("w", suffix=".kubeconfig", delete=False) as own:
        yaml.safe_dump(config, own)
    env["KUBECONFIG"] = own.name
    argv = [sys.executable, "-m", "kvpolicy", "run", "-n", NAMESPACE, "--liveness-port", "0", "--metrics-port", "0"]
    if profile is not None:  # the same command under cProfile and tracemalloc (bench/operator_profile.py)
        argv[1:4] = [str(Path(__file__).with_name("operator_profile.py")), str(profile)]
    operator = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield operator.pid
    finally:
        operator.terminate()
        try:
            operator.wait(timeout=120)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        os.unlink(own.name)


def operator_writes(cluster: ThreadedDevCluster, since: int) -> Counter[str]:
    """The operator's writes after write number `since`, by method, resource and subresource."""
    return Counter(
        f"{write.method} {write.path.plural if write.path else '?'}"
        + (f"/{write.path.subresource}" if write.path and write.path.subresource else "")
        for write in cluster.writes()[since:]
        if write.user == OPERATOR
    )


def run_once(
    count: int,
    waiting_fraction: float,
    poll_seconds: float,
    settle: float,
    give_up: float,
    profile: Path | None,
    steady_only: bool = False,
) -> dict[str, Any]:
    waiting = {index for index in range(count) if index < round(count * waiting_fraction)}
    decided = [index for index in range(count) if index not in waiting]
    pools = [NodePool("h200", "NVIDIA-H200"), NodePool("b200", "NVIDIA-B200"), NodePool(CPU_POOL, None)]
    result: dict[str, Any] = {"policies": count, "waiting": len(waiting)}
    with (
        ThreadedDevCluster(pools=pools, runner=NoProcessRunner(), namespaces=(NAMESPACE,)) as cluster,
        tempfile.TemporaryFile() as log,
    ):
        cluster.apply(crd.crd_object())
        started = time.monotonic()
        # In one call: the kubelet's pass after each of N creations would look at every Deployment, N^2 in all.
        cluster.call(lambda: [cluster.cluster.create(target(index)) for index in decided])
        wait_until(
            "the targets' ReplicaSets",
            lambda: len(cluster.list("apps/v1", "ReplicaSet", NAMESPACE)) >= len(decided),
            give_up,
        )
        result["emulator_seconds_per_target"] = round((time.monotonic() - started) / max(1, len(decided)), 4)
        started = time.monotonic()
        for index in range(count):
            cluster.create(policy(index, index in waiting))
        result["emulator_seconds_per_policy"] = round((time.monotonic() - started) / count, 4)

        def all_written(since: int) -> Callable[[], bool]:
            return lambda: len(first_status_writes(cluster, since)) >= count

        # 1. cold start
        since = len(cluster.writes())
        with operator_process(cluster, poll_seconds, log, profile) as pid:
            sampler = RssSampler(pid)

            def snapshot() -> None:  # tracemalloc's snapshot of the operator (--profile), between the stages
                if profile is not None:
                    os.kill(pid, signal.SIGUSR1)
                    time.sleep(5)

            result["cold_start_seconds"] = round(wait_until("cold start", all_written(since), give_up), 1)
            result["cold_start_peak_rss_mib"] = sampler.peak()
            # 2. steady
            time.sleep(settle)
            result["steady_rss_mib"] = mib(pid)
            snapshot()
            print(json.dumps(result), file=sys.stderr, flush=True)  # so far (a loaded box may not get further)
            if steady_only:
                result["operator_cpu_seconds"] = round(cpu_seconds(pid), 1)
                return result
            # 3. delete all
            for index in range(count):
                cluster.delete(*KVP, f"model-{index}", NAMESPACE)
            wait_until("deletion", lambda: not cluster.list(*KVP, NAMESPACE), give_up, every=2.0)
            time.sleep(settle)
            result["after_delete_rss_mib"] = mib(pid)
            snapshot()
            print(json.dumps(result), file=sys.stderr, flush=True)
            # 4. create at once, the operator running
            sampler.reset()
            since = len(cluster.writes())
            operator_cpu, emulator_cpu = cpu_seconds(pid), time.process_time()
            created: dict[str, float] = {}
            for index in range(count):
                cluster.create(policy(index, index in waiting))
                created[f"model-{index}"] = time.time()
            result["create_seconds"] = round(max(created.values()) - min(created.values()), 1)
            wait_until("first statuses", all_written(since), give_up)
            latencies = [at - created[name] for name, at in first_status_writes(cluster, since).items()]
            result["latency_p50"] = round(statistics.median(latencies), 2)
            for label, q in (("p90", 0.9), ("p99", 0.99)):
                result[f"latency_{label}"] = round(percentile(latencies, q), 2)
            result["latency_max"] = round(max(latencies), 2)
            result["peak_rss_mib"] = sampler.peak()
            # What the batch cost each side: the operator's process, and this one's (the emulated API server and
            # kubelet, and this script's own polling of the write log).
            result["batch_operator_cpu_ms_per_policy"] = round((cpu_seconds(pid) - operator_cpu) * 1e3 / count, 1)
            result["batch_emulator_cpu_ms_per_policy"] = round((time.process_time() - emulator_cpu) * 1e3 / count, 1)
            writes = operator_writes(cluster, since)
            result["batch_operator_writes_per_policy"] = round(sum(writes.values()) / count, 2)
            result["batch_operator_writes"] = dict(writes.most_common())
            result["rss_after_mib"] = mib(pid)
            snapshot()
            result["operator_cpu_seconds"] = round(cpu_seconds(pid), 1)
            sampler.stop()
        log.seek(0)
        tracebacks = log.read().decode(errors="replace").count("Traceback")
        result["operator_tracebacks"] = tracebacks
    return result


def lease_holder(cluster: ThreadedDevCluster) -> str | None:
    lease = cluster.find("coordination.k8s.io/v1", "Lease", LEASE, NAMESPACE)
    holder = (lease or {}).get("spec", {}).get("holderIdentity")
    return str(holder) if holder else None


def takeover_once(count: int, waiting_fraction: float, poll_seconds: float, give_up: float) -> dict[str, Any]:
    """Issue 28 item 5 at N policies: two replicas with leader election; once the leader has decided every policy,
    it is killed (SIGKILL) and one decided policy is edited at that moment. Measured from the kill: when the standby
    holds the Lease, and when it writes the edited policy's status for its new generation (the next action)."""
    waiting = {index for index in range(count) if index < round(count * waiting_fraction)}
    decided = [index for index in range(count) if index not in waiting]
    pools = [NodePool("h200", "NVIDIA-H200"), NodePool("b200", "NVIDIA-B200"), NodePool(CPU_POOL, None)]
    result: dict[str, Any] = {"policies": count, "waiting": len(waiting)}
    election = {"KVPOLICY_LEADER_ELECTION_LEASE": LEASE, "KVPOLICY_LEADER_ELECTION_NAMESPACE": NAMESPACE}
    with (
        ThreadedDevCluster(pools=pools, runner=NoProcessRunner(), namespaces=(NAMESPACE,)) as cluster,
        tempfile.TemporaryFile() as log,
    ):
        cluster.apply(crd.crd_object())
        cluster.call(lambda: [cluster.cluster.create(target(index)) for index in decided])
        for index in range(count):
            cluster.create(policy(index, index in waiting))
        since = len(cluster.writes())
        with (
            operator_process(cluster, poll_seconds, log, extra_env={**election, "KVPOLICY_POD_NAME": "a"}) as a,
            operator_process(cluster, poll_seconds, log, extra_env={**election, "KVPOLICY_POD_NAME": "b"}) as b,
        ):
            wait_until("a leader", lambda: lease_holder(cluster) in ("a", "b"), give_up)
            leader, standby = (a, b) if lease_holder(cluster) == "a" else (b, a)
            new_leader = "b" if lease_holder(cluster) == "a" else "a"
            result["cold_start_seconds"] = round(
                wait_until("cold start", lambda: len(first_status_writes(cluster, since)) >= count, give_up), 1
            )
            time.sleep(5)  # the standby has read the Lease's latest renewals
            result["leader_rss_mib"], result["standby_rss_mib"] = mib(leader), mib(standby)
            edited = f"model-{decided[len(decided) // 2]}"  # one in the middle of the list
            killed = time.time()
            os.kill(leader, signal.SIGKILL)
            edit = {"spec": {"workload": {"typicalContextTokens": 4096}}}
            generation = int(cluster.patch(*KVP, edited, edit, NAMESPACE)["metadata"]["generation"])

            def edit_handled() -> bool:
                status = (cluster.find(*KVP, edited, NAMESPACE) or {}).get("status") or {}
                return bool(status.get("observedGeneration") == generation)

            wait_until("the new leader", lambda: lease_holder(cluster) == new_leader, give_up, every=0.1)
            result["lease_acquired_seconds"] = round(time.time() - killed, 1)
            wait_until("the edit handled", edit_handled, give_up, every=0.1)
            result["next_action_seconds"] = round(time.time() - killed, 1)
            policy_writes = [
                w.time for w in cluster.writes() if w.time > killed and w.path and w.path.plural == KVP_PLURAL
            ]
            result["first_policy_write_seconds"] = round(min(policy_writes) - killed, 1) if policy_writes else None
            result["new_leader_rss_mib"] = mib(standby)
    return result


TAKEOVER_COLUMNS = (
    ("policies", "policies"),
    ("waiting", "waiting"),
    ("cold_start_seconds", "cold start (s)"),
    ("leader_rss_mib", "leader RSS (MiB)"),
    ("standby_rss_mib", "standby RSS (MiB)"),
    ("lease_acquired_seconds", "kill to Lease held (s)"),
    ("first_policy_write_seconds", "kill to the new leader's first policy write (s)"),
    ("next_action_seconds", "kill to next action (s)"),
    ("new_leader_rss_mib", "new leader RSS (MiB)"),
)

COLUMNS = (
    ("policies", "policies"),
    ("waiting", "waiting"),
    ("cold_start_seconds", "cold start: all first statuses (s)"),
    ("cold_start_peak_rss_mib", "cold start: peak RSS (MiB)"),
    ("steady_rss_mib", "steady RSS (MiB)"),
    ("after_delete_rss_mib", "RSS after deleting all (MiB)"),
    ("create_seconds", "created in (s)"),
    ("latency_p50", "first status p50 (s)"),
    ("latency_p90", "p90 (s)"),
    ("latency_p99", "p99 (s)"),
    ("latency_max", "max (s)"),
    ("peak_rss_mib", "peak RSS (MiB)"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--policies", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--waiting", type=float, default=0.1, help="fraction of policies whose target is absent")
    parser.add_argument("--poll-seconds", type=float, default=5.0, help="KVPOLICY_POLL_SECONDS of the operator")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before each steady RSS reading")
    parser.add_argument("--give-up-after", type=float, default=1200.0)
    parser.add_argument("--steady-only", action="store_true", help="stop after the steady RSS (stages 1 and 2)")
    parser.add_argument(
        "--takeover", action="store_true", help="instead: two replicas, the leader killed (issue 28 item 5)"
    )
    parser.add_argument(
        "--profile", type=Path, help="the operator under cProfile and tracemalloc (bench/operator_profile.py), into DIR"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.waiting <= 1:
        parser.error(f"--waiting {args.waiting} is not a fraction between 0 and 1")
    load = os.getloadavg()[0]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine}, load average {load:.1f} at start")
    columns = TAKEOVER_COLUMNS if args.takeover else COLUMNS
    print("| " + " | ".join(title for _, title in columns) + " |")
    print("|" + "---:|" * len(columns))
    for count in args.policies:
        if args.takeover:
            result = takeover_once(count, args.waiting, args.poll_seconds, args.give_up_after)
            print(json.dumps(result), file=sys.stderr, flush=True)
            print("| " + " | ".join(str(result.get(key, "-")) for key, _ in columns) + " |", flush=True)
            continue
        profile = args.profile / str(count) if args.profile else None
        result = run_once(
            count, args.waiting, args.poll_seconds, args.settle, args.give_up_after, profile, args.steady_only
        )
        result["load_average_after"] = round(os.getloadavg()[0], 1)
        print(json.dumps(result), file=sys.stderr, flush=True)
        print("| " + " | ".join(str(result.get(key, "-")) for key, _ in COLUMNS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
