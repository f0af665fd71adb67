"""What the pure step sees and says: observations of the cluster, actions, and the step's result."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from kvpolicy.analysis.checks import CheckVerdict, Stage, combine
from kvpolicy.analysis.model import Verdict
from kvpolicy.api.v1alpha1 import Decision, Difference, GpuFacts, KVPolicyStatus, NotificationEvent, Phase

Obj = dict[str, Any]


class Kind(StrEnum):
    """The kinds of objects the operator writes (the policy's namespace is implied)."""

    DEPLOYMENT = "Deployment"
    SERVICE = "Service"
    JOB = "Job"
    INFERENCE_POOL = "InferencePool"  # inference.networking.k8s.io/v1
    HTTP_ROUTE = "HTTPRoute"  # gateway.networking.k8s.io/v1: the user's; only its backendRefs are patched
    POD = "Pod"  # a canary's own pods: only their labels are patched (a Deployment canary joining the traffic)


@dataclass(frozen=True)
class CustomKind:
    """A kind served by a custom resource (a target kind's CRD): what the executor reads and writes it through."""

    group: str
    version: str
    plural: str
    kind: str

    def __str__(self) -> str:
        return self.kind


ObjectKind = Kind | CustomKind


# ------------------------------------------------------------------------------------------------------ observations


@dataclass(frozen=True)
class PodView:
    name: str
    ip: str | None
    ready: bool
    unschedulable: str | None = None  # the scheduler's message when PodScheduled=False/Unschedulable
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class JobView:
    """A gate Job as far as the step cares: finished or not, and what its pod said."""

    name: str
    succeeded: bool = False
    failed: bool = False
    failure_reason: str | None = None  # the Job's Failed condition reason: DeadlineExceeded, BackoffLimitExceeded
    exit_code: int | None = None
    terminated_reason: str | None = None  # the container's: Error, OOMKilled, ...
    termination_message: str | None = None
    not_starting: str | None = None  # while it runs: why its pod cannot start (image pull, config, no node)

    @property
    def finished(self) -> bool:
        return self.succeeded or self.failed


@dataclass(frozen=True)
class Observations:
    """The cluster as observed for one step. What a phase does not need is left empty (observe.py decides)."""

    now: datetime
    governed_by: str | None = None  # the other KVPolicy that governs the target (ownership.py); None: this one
    target: Obj | None = None
    gpu: GpuFacts | None = None
    canary: Obj | None = None
    canary_pods: tuple[PodView, ...] = ()
    # The target's own pods, when a metrics check compared the canary with them this pass (else empty).
    baseline_pods: tuple[PodView, ...] = ()
    services: frozenset[str] = frozenset()
    jobs: Mapping[str, JobView] = field(default_factory=dict)
    checks: tuple[CheckVerdict, ...] = ()  # the metrics checks evaluated this pass (metric_checks.py)
    route: Obj | None = None  # traffic InferencePool: the HTTPRoute rollout.inferencePool names
    pools: Mapping[str, Obj] = field(default_factory=dict)  # InferencePools by name (the baseline's, the canary's)
    # endpointPicker CopyBaseline: "Service/<name>" and "Deployment/<name>": the baseline's EPP and the copy.
    pickers: Mapping[str, Obj] = field(default_factory=dict)

    def verdicts(self, stage: Stage) -> tuple[CheckVerdict, ...]:
        return tuple(result for result in self.checks if result.check.stage is stage)

    def analysis_verdict(self) -> Verdict | None:
        """This pass's latency analysis check, every ANALYSIS entry's verdict combined; None: no check was due."""
        verdicts = [result.verdict for result in self.verdicts(Stage.ANALYSIS)]
        return combine(verdicts) if verdicts else None


# ----------------------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Create:
    """Create an object; AlreadyExists counts as done (names are deterministic)."""

    kind: ObjectKind
    body: Obj

    @property
    def name(self) -> str:
        name: str = self.body["metadata"]["name"]
        return name


@dataclass(frozen=True)
class Patch:
    kind: ObjectKind
    name: str
    patch: Obj | list[Obj]
    patch_type: Literal["merge", "json"] = "merge"


@dataclass(frozen=True)
class Delete:
    """Delete an object; NotFound counts as done. Dependents (a Job's pods) go in the background."""

    kind: ObjectKind
    name: str


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = Create | Patch | Delete


@dataclass(frozen=True)
class Notice:
    """What notification receivers are told about one step: a phase change, a decision, or drift of the target. Sent
    at the edge after the status is written, like events."""

    kind: NotificationEvent
    phase: Phase
    previous_phase: Phase | None
    rollout_id: str | None
    message: str
    at: datetime
    decision: Decision | None = None
    differences: tuple[Difference, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """The new status, the API writes to make (in order, before the status), events to post after it, notices for
    the notification receivers, and when to look again (seconds)."""

    status: KVPolicyStatus
    actions: tuple[Action, ...]
    events: tuple[Event, ...]
    requeue_after: float
    notices: tuple[Notice, ...] = ()


def default_gate_resources() -> Obj:
    """The accuracy and latency gate Jobs' resources unless the operator is told otherwise (chart: gateJobs)."""
    return {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


@dataclass(frozen=True)
class StepConfig:
    """Operator-wide settings the step needs."""

    gate_image: str
    probe_image: str
    poll_seconds: float = 5.0  # how soon to look again while something is starting or running
    idle_seconds: float = 300.0  # how soon to look again in a decided phase
    gate_resources: Obj = field(default_factory=default_gate_resources)  # of the accuracy and latency gate Jobs
    preflight_resources: Obj = field(default_factory=dict)  # of the GPU preflight Job, besides its one GPU


def timestamp(moment: datetime) -> str:
    """RFC 3339 with milliseconds: phase deadlines of a few seconds stay exact."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_timestamp(text: str | None) -> datetime | None:
    if not text:
        return None
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
