"""What every Job gate is (after Argo Rollouts' job metric provider): how its Job is built, how long it may run, how
its report becomes a status record, and how that record becomes a transition. One module per gate in this package
(`preflight.py`, `accuracy.py`, `latency_probe.py`), which the registry (`__init__.py`) finds. A `JobGate` is a
`Gate` (analysis/checks.py) of kind Job, as a metrics check is one of kind Metrics.

The step runs every gate the same way (`tick.run_job`): create the Job if it is missing, time it out past its
deadline, read its `GateReport` when it has finished. A gate of its own phase (GPU preflight, accuracy) then moves
the rollout on as its `Judgement` says; the latency probe's judgement feeds the latency phase instead.

A gate may decline to run its Job for a plan (`skip`): its judgement then moves the rollout on at once.

Pure: nothing here reads the cluster or the state machine, so observe and the spec-derived rules can use the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

from kvpolicy.analysis.checks import GateKind, GateOutcome, Transition
from kvpolicy.api.reasons import REPORT_PROBLEMS
from kvpolicy.api.v1alpha1 import (
    AnalysisPhase,
    ConditionStatus,
    ConditionType,
    GateResult,
    GateVerdict,
    KVPolicySpec,
    KVPolicyStatus,
    Phase,
    Plan,
)
from kvpolicy.gate_programs.report import GateReport
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.step_types import Event, JobView, Obj, StepConfig


@dataclass(frozen=True)
class JobInputs:
    """What a gate Job is built from."""

    spec: KVPolicySpec
    config: StepConfig
    name: str
    pod_spec: Obj  # the target's serving pods': the GPU Jobs share their pool and their images' registry
    plan: Plan
    canary_url: str
    baseline_url: str


class Then(Enum):
    """What a gate's record does to the rollout."""

    ADVANCE = auto()  # on to the next phase (for the latency probe: promote after the bake)
    ROLLBACK = auto()
    INCONCLUSIVE = auto()  # the phase's onInconclusive decides (latency probe only)


@dataclass(frozen=True)
class Decided:
    """The decision a rollback takes."""

    reason: str
    message: str


@dataclass(frozen=True)
class Judgement:
    """A gate record's transition: the gate's condition, an event, and what happens next. A rollback decides with
    `decision`, else with the condition's reason and message."""

    then: Then
    status: ConditionStatus
    reason: str
    message: str
    event: Event | None = None
    decision: Decided | None = None

    @property
    def decided(self) -> Decided:
        return self.decision or Decided(self.reason, self.message)


@dataclass(frozen=True)
class JobGate:
    # The Job's name part (<policy>-<name>-g<generation>), and the gate label of kvpolicy_gate_results_total that
    # the alert rules match on.
    name: str
    # How `kubectl kvpolicy` names it (the planner's name for it in status.plan.gates).
    label: str
    phase: Phase
    condition: ConditionType
    runs: Callable[[KVPolicySpec, Plan], bool]
    build: Callable[[JobInputs], b.GateJob]
    deadline_seconds: Callable[[KVPolicySpec], int]
    record: Callable[[KVPolicySpec, JobView, GateReport], GateResult]
    timed_out: Callable[[KVPolicySpec], GateResult]
    judge: Callable[[KVPolicySpec, GateResult], Judgement]
    result: Callable[[KVPolicyStatus], GateResult | None]
    set_result: Callable[[KVPolicyStatus, GateResult | None], None]
    skip: Callable[[Plan], GateResult | None] = lambda plan: None  # a record made without a Job, when it cannot run
    # The least recovery the gate accepts (kvpolicy_gate_min_recovery_ratio, which KVPolicyAccuracyRecoveryLow compares
    # the recovery with); None for a gate that measures no recovery.
    min_recovery: Callable[[KVPolicySpec], float | None] = lambda spec: None
    # The most samples the gate takes, which `kubectl kvpolicy` shows beside its progress; None: not counted.
    sample_cap: Callable[[KVPolicySpec], int | None] = lambda spec: None

    @property
    def kind(self) -> GateKind:
        return GateKind.JOB

    def finished(self, before: KVPolicyStatus, after: KVPolicyStatus) -> GateResult | None:
        """Its record, when it turned from absent or Running into a verdict between two statuses."""
        old, new = self.result(before), self.result(after)
        running = AnalysisPhase.RUNNING
        if new is not None and new.verdict.phase is not running and (old is None or old.verdict.phase is running):
            return new
        return None

    def outcomes(self, spec: KVPolicySpec, change: Transition) -> list[GateOutcome]:
        """Its record once it is final, with the least recovery the gate accepts."""
        record = self.finished(change.before, change.after)
        return [] if record is None else [GateOutcome(self.name, record.verdict, record, self.min_recovery(spec))]


def readable(report: GateReport, verdicts: tuple[GateVerdict, ...]) -> bool:
    return report.reason not in REPORT_PROBLEMS and report.verdict in verdicts


def no_verdict(view: JobView, report: GateReport) -> str:
    """How a gate Job without a verdict ended, and the last its pod said (the report's problem quotes the tail of a
    crashed tool's log): "exit code 1 (Error): the gate's output is no report: '...ConnectionError...'"."""
    ended = [view.failure_reason] if view.failure_reason else []
    if view.exit_code is not None:
        reason = f" ({view.terminated_reason})" if view.terminated_reason else ""
        ended.append(f"exit code {view.exit_code}{reason}")
    return f"{', '.join(ended) or 'no verdict'}: {report.message}" if report.message else ", ".join(ended)


def tool_job(inputs: JobInputs, command: Callable[[KVPolicySpec, str, str], list[str]], timeout: int) -> b.GateJob:
    """A Job running one of the operator image's gate tools against the canary and baseline Services."""
    return b.GateJob(
        name=inputs.name,
        role=b.ROLE_GATE,
        image=inputs.config.gate_image,
        command=command(inputs.spec, inputs.canary_url, inputs.baseline_url),
        timeout_seconds=timeout,
        resources=inputs.config.gate_resources,
        pod_placement={},
        image_pull_secrets=b.image_pull_secrets(inputs.pod_spec),
        env=b.api_key_env(inputs.spec),
    )
