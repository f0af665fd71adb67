"""Builders for the operator's unit tests: policies, target Deployments, observations, and a driver that replays
a step's actions against an in-memory world so multi-step scenarios stay pure."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import jsonpatch
from kvpolicy.analysis.checks import CheckVerdict
from kvpolicy.analysis.model import SideMetrics, Verdict
from kvpolicy.analysis.provider import ServedReading
from kvpolicy.analysis.served import CANARY_CONFIG, ServedSides
from kvpolicy.api.v1alpha1 import GateVerdict, GpuFacts, KVPolicy, Phase, TargetKind
from kvpolicy.kube.observe import PHASE_NEEDS
from kvpolicy.planning.gpu import KNOWN_PRODUCTS, gpu_facts
from kvpolicy.rollout.metric_checks import LATENCY
from kvpolicy.rollout.rules import rollout_hash
from kvpolicy.rollout.step import step
from kvpolicy.rollout.step_types import (
    Create,
    Delete,
    JobView,
    Kind,
    ObjectKind,
    Observations,
    Patch,
    PodView,
    StepConfig,
    StepResult,
)
from kvpolicy.rollout.targets.base import ServingTarget
from kvpolicy.rollout.targets.deployment import DeploymentTarget

NAMESPACE = "serving"
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
CONFIG = StepConfig(gate_image="kvpolicy:test", probe_image="probe:test", poll_seconds=5, idle_seconds=300)
PATCHED_IMAGE = "vllm-fp8-twolevel:1"
TARGET_IMAGE = "vllm:0.12"
TARGET_ARGS = ["serve", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "131072", "--port", "8000"]


# The phase changes of a rollout that passes its gates, as notifications report them: (previous, new).
PROMOTED_ROLLOUT = [
    (None, "Planning"),
    ("Planning", "CanaryStarting"),
    ("CanaryStarting", "AccuracyGate"),
    ("AccuracyGate", "LatencyAnalysis"),
    ("LatencyAnalysis", "Promoting"),
    ("Promoting", "Promoted"),
]


def gpu(product: str) -> GpuFacts:
    return gpu_facts([KNOWN_PRODUCTS[product]])


def set_paths(spec: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Apply {"rollout.abort": True, ...} to a spec dict."""
    for path, value in overrides.items():
        node = spec
        keys = path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return spec


def policy_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "targetRef": {"name": "llama"},
        "model": {"servedModelName": "llama", "headDim": 128, "numLayers": 32, "maxModelLen": 131072},
        "workload": {"maxContextTokens": 131072, "typicalContextTokens": 65536},
        "images": {"fp8Patched": PATCHED_IMAGE},
        "gates": {"latency": {"enabled": False}},
        "rollout": {"progressDeadlineSeconds": 600, "bakeSeconds": 0},
    }
    return set_paths(spec, overrides)


def make_policy(generation: int = 1, status: Mapping[str, Any] | None = None, **spec: Any) -> KVPolicy:
    return KVPolicy.model_validate(
        {
            "metadata": {"name": "llama-fp8", "namespace": NAMESPACE, "uid": "uid-1", "generation": generation},
            "spec": policy_spec(**spec),
            "status": dict(status or {}),
        }
    )


# A target its controller has rolled out: every one of its 2 replicas (pods, or LWS groups) current and ready. The
# gates wait for that before they compare a canary with it.
ROLLED_OUT = {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}


def target_deployment(args: list[str] | None = None, image: str = TARGET_IMAGE) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama", "namespace": NAMESPACE, "generation": 1},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "llama"}},
            "template": {
                "metadata": {"labels": {"app": "llama", "tier": "serving"}},
                "spec": {
                    "nodeSelector": {"pool": "h200"},
                    "containers": [
                        {
                            "name": "vllm",
                            "image": image,
                            "args": list(TARGET_ARGS if args is None else args),
                            "env": [{"name": "HF_HOME", "value": "/cache"}],
                            "ports": [{"name": "http", "containerPort": 8000}],
                        }
                    ],
                },
            },
        },
        "status": dict(ROLLED_OUT),
    }


MODEL = TARGET_ARGS[1]
# Multi-host vLLM without Ray (vLLM's --nnodes/--node-rank/--headless): two nodes of 8 GPUs, TP 8 within a node, PP 2.
LWS_PARALLEL = ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2"]
LWS_LEADER_ARGS = [*TARGET_ARGS, *LWS_PARALLEL, "--node-rank", "0", "--master-addr", "$(LWS_LEADER_ADDRESS)"]
LWS_WORKER_ARGS = [
    *["serve", MODEL, *LWS_PARALLEL, "--node-rank", "1", "--master-addr", "$(LWS_LEADER_ADDRESS)", "--headless"]
]


def target_leaderworkerset(
    leader_args: list[str] | None = None, worker_args: list[str] | None = None, image: str = TARGET_IMAGE
) -> dict[str, Any]:
    """A LeaderWorkerSet `llama` of one group: a leader serving the API and one headless worker."""

    def template(role: str, args: list[str]) -> dict[str, Any]:
        container: dict[str, Any] = {"name": "vllm", "image": image, "args": list(args)}
        if role == "leader":
            container["ports"] = [{"name": "http", "containerPort": 8000}]
        return {
            "metadata": {"labels": {"app": "llama", "role": role}},
            "spec": {"nodeSelector": {"pool": "h200"}, "containers": [container]},
        }

    worker = LWS_WORKER_ARGS if worker_args is None else worker_args
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "llama", "namespace": NAMESPACE, "generation": 1},
        "spec": {
            "replicas": 2,
            "leaderWorkerTemplate": {
                "size": 2,
                "leaderTemplate": template("leader", LWS_LEADER_ARGS if leader_args is None else leader_args),
                "workerTemplate": template("worker", worker),
            },
        },
        "status": dict(ROLLED_OUT),
    }


def target_llminferenceservice(env: list[dict[str, Any]] | None = None, image: str = TARGET_IMAGE) -> dict[str, Any]:
    """An LLMInferenceService `llama` of two replicas, TP 4 by spec.parallelism, member of routing group `llama`,
    its flags in VLLM_ADDITIONAL_ARGS as KServe's preset passes them to `vllm serve`."""
    flags = [{"name": "VLLM_ADDITIONAL_ARGS", "value": "--max-model-len 131072 --enable-prefix-caching"}]
    container = {"name": "main", "image": image, "env": [*flags, *(env or [])]}
    return {
        "apiVersion": "serving.kserve.io/v1alpha2",
        "kind": "LLMInferenceService",
        "metadata": {"name": "llama", "namespace": NAMESPACE, "generation": 1},
        "spec": {
            "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "name": MODEL},
            "replicas": 2,
            "parallelism": {"tensor": 4},
            "template": {"nodeSelector": {"pool": "h200"}, "containers": [container]},
            "router": {"route": {"group": "llama", "weight": 100}, "gateway": {}, "scheduler": {}},
        },
        "status": {
            "observedGeneration": 1,
            "conditions": [{"type": "Ready", "status": "True"}],
            "router": {"group": {"name": "llama", "members": [{"name": "llama", "weight": 100}]}},
        },
    }


def gate_output(verdict: str, **fields: Any) -> str:
    return json.dumps({"gate": "accuracy", "verdict": verdict, **fields})


def serving_pod_labels(kind: ServingTarget, obj: Mapping[str, Any]) -> dict[str, str]:
    """The labels the serving pods of `obj` get from its controller: its pod template's, or for an
    LLMInferenceService, KServe's workload labels and spec.labels."""
    if kind.kind == TargetKind.LLM_INFERENCE_SERVICE:
        return {**kind.serving_selector(obj), **(obj["spec"].get("labels") or {})}
    return kind.traffic_labels(obj)


def merge(obj: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """Apply an RFC 7386 merge patch in place."""
    for key, value in patch.items():
        if value is None:
            obj.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(obj.get(key), dict):
            merge(obj[key], value)
        else:
            obj[key] = copy.deepcopy(value)


@dataclass
class World:
    """An in-memory cluster the actions of a step are applied to; pods become ready when the test says so."""

    target: dict[str, Any] | None = field(default_factory=target_deployment)
    gpu: GpuFacts = field(default_factory=lambda: gpu("H200"))
    kind: ServingTarget = field(default_factory=DeploymentTarget)  # the target's kind: what its canaries are
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)  # the canaries, whatever their kind
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    job_views: dict[str, JobView] = field(default_factory=dict)
    pods: dict[str, PodView] = field(default_factory=dict)
    creates: list[str] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    target_patches: int = 0
    pod_patches: int = 0

    def apply(self, result: StepResult) -> None:
        for action in result.actions:
            if isinstance(action, Create):
                store = self._store(action.kind)
                self.creates.append(f"{action.kind}/{action.name}")
                store.setdefault(action.name, copy.deepcopy(action.body))
            elif isinstance(action, Delete):
                self.deletes.append(f"{action.kind}/{action.name}")
                self._store(action.kind).pop(action.name, None)
                self.job_views.pop(action.name, None) if action.kind == Kind.JOB else None
                if action.kind not in (Kind.SERVICE, Kind.JOB):
                    self.pods = {k: p for k, p in self.pods.items() if not k.startswith(action.name)}
            elif isinstance(action, Patch):
                self._patch(action)

    def _store(self, kind: ObjectKind) -> dict[str, dict[str, Any]]:
        stores = {Kind.SERVICE: self.services, Kind.JOB: self.jobs}
        assert kind in stores or kind == self.kind.object_kind, f"{kind} is not the target's kind"
        return stores.get(kind, self.deployments)

    def _patch(self, action: Patch) -> None:
        if action.kind == Kind.POD:  # only a pod's labels are ever patched; the pod keeps running
            assert action.patch_type == "merge" and isinstance(action.patch, dict)
            pod = self.pods[action.name]
            labels = {**pod.labels, **action.patch["metadata"]["labels"]}
            self.pods[action.name] = dataclasses.replace(pod, labels=labels)
            self.pod_patches += 1
            return
        assert action.kind == self.kind.object_kind
        if self.target is not None and action.name == self.target["metadata"]["name"]:
            assert action.patch_type == "json"
            self.target = jsonpatch.apply_patch(self.target, action.patch)
            self.target_patches += 1
            return
        deployment = self.deployments[action.name]
        assert action.patch_type == "merge" and isinstance(action.patch, dict)
        merge(deployment, action.patch)
        # The canary's pods are replaced (Recreate); the new ones start unready.
        self.pods = {k: p for k, p in self.pods.items() if not k.startswith(action.name)}

    def canary_up(self, ready: bool = True, unschedulable: str | None = None) -> None:
        """Give the canary Deployment its pods, with its current template labels."""
        for name, deployment in self.deployments.items():
            labels = serving_pod_labels(self.kind, deployment)
            for index in range(deployment["spec"]["replicas"]):
                pod = f"{name}-{index}"
                # A pod still there keeps the labels it was given (a joined Deployment canary's).
                kept = self.pods[pod].labels if pod in self.pods else {}
                self.pods[pod] = PodView(pod, "127.0.0.5", ready, unschedulable, {**kept, **labels})

    def finish_job(self, gate: str, output: str | None, exit_code: int = 0, failure: str | None = None) -> None:
        # The newest generation's Job of that gate (an edited spec leaves the earlier one behind).
        def rollout(name: str) -> tuple[int, int]:
            generation, _, run = name.rsplit("-g", 1)[1].partition("r")
            return int(generation), int(run or 1)

        name = max((n for n in self.jobs if f"-{gate}-g" in n), key=rollout)
        self.job_views[name] = JobView(
            name,
            succeeded=exit_code == 0 and failure is None,
            failed=exit_code != 0 or failure is not None,
            failure_reason=failure,
            exit_code=exit_code,
            termination_message=output,
        )

    def observe(self, now: datetime, phase: str | None = None, **extra: Any) -> Observations:
        """What observe.py would read in this phase (everything when no phase is given)."""
        needs = PHASE_NEEDS.get(Phase(phase), frozenset()) if phase else {"canary", "pods", "services", "jobs"}
        canary = next(iter(self.deployments.values()), None)
        views = {name: self.job_views.get(name, JobView(name)) for name in self.jobs}
        return Observations(
            now=now,
            target=copy.deepcopy(self.target),
            gpu=self.gpu,
            canary=copy.deepcopy(canary) if "canary" in needs else None,
            canary_pods=tuple(self.pods.values()) if "pods" in needs else (),
            services=frozenset(self.services) if "services" in needs else frozenset(),
            jobs=views if "jobs" in needs else {},
            **extra,
        )


@dataclass
class Driver:
    """Runs steps against a World, carrying the status forward like the operator does."""

    policy: KVPolicy
    world: World = field(default_factory=World)
    now: datetime = T0
    results: list[StepResult] = field(default_factory=list)

    def tick(self, seconds: float = 1.0, settle: bool = True, **extra: Any) -> StepResult:
        """One pass after `seconds`; with `settle`, further passes right away while the step asks for them (requeue
        0), as the operator's loop does. Returns the first pass's result."""
        self.now += timedelta(seconds=seconds)
        first = self._pass(**extra)
        result = first
        for _ in range(10):
            if not settle or result.requeue_after > 0:
                break
            result = self._pass()
        return first

    def _checks(
        self,
        canary_served: ServedReading | None,
        baseline_served: ServedReading | None,
        latency_verdict: Verdict | None,
    ) -> dict[str, Any]:
        """What the observer's metrics checks would say: the canary configuration check on a served reading (against
        the target's own pods' reading, the canary's when not given), the TTFT/ITL check's verdict as given."""
        checks = []
        if canary_served is not None:
            sides = ServedSides(canary_served, baseline_served or canary_served)
            checks.append(CheckVerdict(CANARY_CONFIG, CANARY_CONFIG.assess(self.policy, sides)))
        if latency_verdict is not None:
            checks.append(CheckVerdict(LATENCY, latency_verdict))
        return {"checks": tuple(checks)} if checks else {}

    def _pass(
        self,
        canary_served: ServedReading | None = None,
        baseline_served: ServedReading | None = None,
        latency_verdict: Verdict | None = None,
        **extra: Any,
    ) -> StepResult:
        extra.update(self._checks(canary_served, baseline_served, latency_verdict))
        status = self.policy.status
        planning = status.spec_hash != rollout_hash(self.policy.spec) or not status.phase
        phase = "Planning" if planning else status.phase
        result = step(self.policy, self.world.observe(self.now, phase, **extra), CONFIG)
        self.world.apply(result)
        self.policy = self.policy.model_copy(update={"status": result.status})
        self.results.append(result)
        return result

    def edit(self, overrides: Mapping[str, Any]) -> None:
        """Change the spec the way a user would: a new generation."""
        generation = int(self.policy.metadata["generation"]) + 1
        self.policy = KVPolicy.model_validate(
            {
                "metadata": {**self.policy.metadata, "generation": generation},
                "spec": set_paths(self.policy.spec.to_k8s(), overrides),
                "status": self.policy.status.to_k8s(),
            }
        )

    @property
    def phase(self) -> str | None:
        return self.policy.status.phase

    def reasons(self) -> list[str]:
        return [event.reason for result in self.results for event in result.events]

    def condition(self, type_: str) -> tuple[str, str] | None:
        for cond in self.policy.status.conditions:
            if cond.type == type_:
                return cond.status, cond.reason
        return None


def run_to_canary(driver: Driver) -> None:
    """Plan, then bring the canary up."""
    driver.tick()
    assert driver.phase == "CanaryStarting"
    driver.world.canary_up()


def to_accuracy_gate(driver: Driver) -> None:
    run_to_canary(driver)
    driver.tick()
    assert driver.phase == "AccuracyGate"


def side(role: str, requests: float, ttft: float) -> SideMetrics:
    return SideMetrics(role, True, requests, 60.0, {0.5: ttft, 0.95: ttft}, {0.5: 0.01, 0.95: 0.01})


def verdict(kind: GateVerdict) -> Verdict:
    canary_ttft = 0.2 if kind == GateVerdict.BREACH else 0.1
    return Verdict(kind, kind.value, kind.value, (), side("canary", 100, canary_ttft), side("baseline", 100, 0.1))


def live(**spec: Any) -> Driver:
    driver = Driver(make_policy(**{"gates.accuracy.enabled": False, "gates.latency.enabled": True, **spec}))
    run_to_canary(driver)
    driver.tick()  # joins: a Deployment's running pods are labelled, other kinds' replaced
    if not driver.world.pods:
        driver.world.canary_up()
    driver.tick()
    assert driver.policy.status.latency.started_at is not None
    return driver
