"""One step's working state (`Tick`) and the transitions every phase uses: restart, rollback, advance, promote, and
running a Job gate."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from kvpolicy.api.reasons import DecisionReason, Reason
from kvpolicy.api.v1alpha1 import (
    TERMINAL_PHASES,
    ApplyMode,
    Approval,
    CanaryRef,
    ConditionStatus,
    ConditionType,
    Decision,
    DecisionResult,
    Difference,
    GateResult,
    GateVerdict,
    KVCacheDtype,
    KVPolicy,
    LatencyAnalysis,
    NotificationEvent,
    Phase,
    Plan,
)
from kvpolicy.gate_programs.report import read_report
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.conditions import condition_holds, find_condition, set_condition
from kvpolicy.rollout.gates import JOB_GATES, PHASE_GATES
from kvpolicy.rollout.gates.job import JobGate, JobInputs
from kvpolicy.rollout.step_types import (
    Action,
    Create,
    Delete,
    Event,
    JobView,
    Kind,
    Notice,
    Obj,
    Observations,
    StepConfig,
    StepResult,
    parse_timestamp,
    timestamp,
)
from kvpolicy.rollout.targets import target_kind
from kvpolicy.rollout.traffic_routes import restore_actions

HISTORY_LIMIT = 10
# Phases with a canary running: they watch it, and `paused` holds them.
CANARY_PHASES = frozenset(
    {Phase.CANARY_STARTING, *(gate.phase for gate in PHASE_GATES), Phase.LATENCY_ANALYSIS, Phase.AWAITING_APPROVAL}
)
# Phases whose plan still steers what happens: a change of the pool's GPUs plans the rollout again (observe reads the
# nodes in them). HeldBF16 included: a plan held on an unknown or unsuitable GPU is made again on the new one.
REPLAN_PHASES = CANARY_PHASES | {Phase.HELD_BF16}


@dataclass(frozen=True)
class _Noted:
    """A notice as the step takes it; a phase change's message is the last event the step posts in that phase."""

    kind: NotificationEvent
    phase: Phase
    previous_phase: Phase | None
    rollout_id: str | None
    first_event: int
    decision: Decision | None = None
    differences: tuple[Difference, ...] = ()
    message: str = ""


class Tick:
    """The working state of one step: a copy of the status, and the actions, events and notices it accumulates."""

    def __init__(self, policy: KVPolicy, obs: Observations, config: StepConfig) -> None:
        self.spec = policy.spec
        self.target_kind = target_kind(policy.spec.target_ref)
        self.obs = obs
        self.now = obs.now
        self.config = config
        self.status = policy.status.model_copy(deep=True)
        metadata = policy.metadata
        self.generation = int(metadata.get("generation") or 1)
        self.ref = b.PolicyRef(
            name=str(metadata.get("name", "")),
            namespace=str(metadata.get("namespace", "")),
            uid=str(metadata.get("uid", "")),
        )
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.noted: list[_Noted] = []
        self.requeue = config.poll_seconds

    # -------------------------------------------------------------------------------------------- bookkeeping

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))
        self.status.message = message

    def condition(self, type_: ConditionType, status: ConditionStatus, reason: str, message: str = "") -> bool:
        """Set a condition; True when its status changed (a transition worth an event)."""
        previous = set_condition(
            self.status.conditions, type_, status, reason, message, timestamp(self.now), self.generation
        )
        return previous is None or previous.status != status

    def condition_is(self, type_: ConditionType, status: ConditionStatus) -> bool:
        return condition_holds(self.status.conditions, type_, status)

    def condition_reason(self, type_: ConditionType) -> str | None:
        found = find_condition(self.status.conditions, type_)
        return found.reason if found is not None else None

    def enter(self, phase: Phase) -> None:
        previous = self.status.phase
        self.status.phase = phase
        self.status.phase_entered_at = timestamp(self.now)
        if previous != phase:
            self.noted.append(
                _Noted(NotificationEvent.PHASE_CHANGED, phase, previous, self.status.rollout_id, len(self.events))
            )

    def notice_drift(self, differences: list[Difference], message: str) -> None:
        self.noted.append(
            _Noted(
                NotificationEvent.DRIFTED,
                self.phase,
                self.phase,
                self.status.rollout_id,
                len(self.events),
                differences=tuple(differences),
                message=message,
            )
        )

    @property
    def phase(self) -> Phase:
        return self.status.phase or Phase.PLANNING

    def phase_age(self) -> float:
        entered = parse_timestamp(self.status.phase_entered_at) or self.now
        return (self.now - entered).total_seconds()

    def decide(self, result: DecisionResult, reason: str, message: str) -> None:
        decision = Decision(
            result=result,
            reason=reason,
            message=message,
            generation=self.generation,
            kv_cache_dtype=KVCacheDtype.FP8 if result == DecisionResult.PROMOTED else KVCacheDtype.BF16,
            time=timestamp(self.now),
        )
        self.status.decision = decision
        self.status.history = [*self.status.history, decision][-HISTORY_LIMIT:]
        self.noted.append(
            _Noted(
                NotificationEvent.DECIDED,
                self.phase,
                self.phase,
                self.status.rollout_id,
                len(self.events),
                decision=decision,
                message=f"{result.value} ({reason}): {message}",
            )
        )

    def add(self, action: Action) -> None:
        self.actions.append(action)

    # ----------------------------------------------------------------------------------------------- lookups

    @property
    def advisory(self) -> bool:
        return self.spec.rollout.apply_mode == ApplyMode.ADVISORY

    @property
    def plan(self) -> Plan:
        if self.status.plan is None:  # pragma: no cover - every phase after Planning records the plan
            raise RuntimeError(f"phase {self.phase} without a plan in status")
        return self.status.plan

    @property
    def canary(self) -> CanaryRef:
        if self.status.canary is None:  # pragma: no cover - every canary phase records the canary
            raise RuntimeError(f"phase {self.phase} without a canary in status")
        return self.status.canary

    def baseline_service_name(self) -> str:
        return b.baseline_service_name(self.ref.name, self.canary.generation, self.canary.run)

    def job(self, gate: JobGate) -> str:
        return b.job_name(self.ref.name, gate.name, self.canary.generation, self.canary.run)

    def serving_port(self) -> int:
        assert self.obs.target is not None
        return self.target_kind.serving_port(self.obs.target, self.spec.target_ref.container)

    def url(self, service: str) -> str:
        return b.service_url(service, self.ref.namespace, self.serving_port())

    def job_inputs(self, gate: JobGate) -> JobInputs:
        assert self.obs.target is not None
        return JobInputs(
            spec=self.spec,
            config=self.config,
            name=self.job(gate),
            pod_spec=self.target_kind.pod_spec(self.obs.target),
            plan=self.plan,
            canary_url=self.url(self.canary.service),
            baseline_url=self.url(self.baseline_service_name()),
        )

    @property
    def observed_canary(self) -> Obj | None:
        """The observed canary Deployment, if it is this rollout's."""
        canary = self.obs.canary
        if canary is None or canary["metadata"]["name"] != self.canary.deployment:
            return None
        return canary

    def ready_canary_pods(self, joined: bool) -> int:
        target_labels = self.target_kind.traffic_labels(self.obs.target) if joined and self.obs.target else {}
        return sum(
            1
            for pod in self.obs.canary_pods
            if pod.ready
            and pod.labels.get(b.CANARY_LABEL) == self.canary.deployment
            and all(pod.labels.get(k) == v for k, v in target_labels.items())
        )

    def notices(self) -> tuple[Notice, ...]:
        found = []
        changes = [noted for noted in self.noted if noted.kind == NotificationEvent.PHASE_CHANGED]
        for noted in self.noted:
            message = noted.message
            if not message:  # a phase change: the last event posted before the next phase change
                later = [other.first_event for other in changes if other.first_event > noted.first_event]
                posted = self.events[noted.first_event : later[0] if later else len(self.events)]
                message = posted[-1].message if posted else (self.status.message or "")
            found.append(
                Notice(
                    kind=noted.kind,
                    phase=noted.phase,
                    previous_phase=noted.previous_phase,
                    rollout_id=noted.rollout_id,
                    message=message,
                    at=self.now,
                    decision=noted.decision,
                    differences=noted.differences,
                )
            )
        return tuple(found)

    def result(self) -> StepResult:
        # Conditions that survived this step hold for the generation it looked at (a spec change that would void
        # them restarts the rollout and clears them).
        for condition in self.status.conditions:
            condition.observed_generation = self.generation
        return StepResult(self.status, tuple(self.actions), tuple(self.events), max(0.0, self.requeue), self.notices())


# ------------------------------------------------------------------------------------------------------ transitions


def rollout_id(uid: str, generation: int, spec_hash: str, started_at: str) -> str:
    """`<generation>-<6 hex>`: names one rollout; a rollout run again (even at the same generation) gets another."""
    digest = hashlib.sha256(f"{uid}/{generation}/{spec_hash}/{started_at}".encode()).hexdigest()[:6]
    return f"{generation}-{digest}"


def restart(t: Tick, spec_hash: str, why: str, warning: Reason | None = None, *, target_changed: bool = False) -> None:
    """A new rollout: clean up the previous one's children and plan again. History and the recorded template stay,
    so a later rollback still restores the configuration from before any promotion; unless the target itself
    changed (`target_changed`): then the next promotion records it afresh. A Drifted condition stays, saying why.
    `warning`: say why with a Warning event of that reason (the cluster changed under the rollout) instead of a
    Normal restart event."""
    previous = t.status
    # The user's route first (traffic InferencePool): it must not send anyone to a canary being removed.
    route_actions, route_restored = restore_actions(previous, t.obs)
    t.actions += route_actions
    if previous.canary is not None and t.phase not in TERMINAL_PHASES:
        for action in t.target_kind.retire(previous.canary.deployment):
            t.add(action)
        t.add(Delete(Kind.SERVICE, previous.canary.service))
        baseline = b.baseline_service_name(t.ref.name, previous.canary.generation, previous.canary.run)
        t.add(Delete(Kind.SERVICE, baseline))
        for gate in JOB_GATES:
            result = gate.result(previous)
            if result is not None and result.job and result.verdict == GateVerdict.RUNNING:
                t.add(Delete(Kind.JOB, result.job))
    if previous.retained_canary is not None:  # a promoted canary kept as a way back: a new rollout replaces it
        t.add(Delete(t.target_kind.object_kind, previous.retained_canary))
    if warning is not None:
        t.event("Warning", warning, why)
    elif previous.spec_hash is not None:
        reason = Reason.ANALYSIS_RESTARTED if t.phase not in TERMINAL_PHASES else Reason.ROLLOUT_RESTARTED
        t.event("Normal", reason, why)
    run = (previous.rollout_run or 1) + 1 if previous.rollout_generation == t.generation else 1
    started = timestamp(t.now)
    t.status = previous.model_copy(
        update={
            "plan": None,
            "gpu": None,
            "canary": None,
            "latency": None,
            "decision": None,
            "conditions": [c for c in previous.conditions if c.type == ConditionType.DRIFTED],
            "spec_hash": spec_hash,
            "rollout_generation": t.generation,
            "rollout_run": run,
            "rollout_started_at": started,
            "rollout_id": rollout_id(t.ref.uid, t.generation, spec_hash, started),
            "target_base": None,
            "target_decided": None,
            "advice": None,
            "traffic": None if route_restored else previous.traffic,  # else put back by the next rollout
            "routing_group": None,
            "retained_canary": None,
            "previous_template": None if target_changed else previous.previous_template,
        }
    )
    for gate in PHASE_GATES:
        gate.set_result(t.status, None)
    t.status.message = why
    t.enter(Phase.PLANNING)


def rollback(t: Tick, reason: str, message: str) -> None:
    t.enter(Phase.ROLLING_BACK)
    t.decide(DecisionResult.ROLLED_BACK, reason, message)
    t.condition(ConditionType.ROLLED_BACK, ConditionStatus.FALSE, reason, f"rolling back: {message}")
    t.event("Warning", Reason.ROLLING_BACK, f"{reason}: {message}")
    # The rollback itself starts with the next pass, which observes everything it must remove.
    t.requeue = 0


def _gate_sequence(t: Tick) -> list[Phase]:
    gates = [gate.phase for gate in PHASE_GATES if gate.runs(t.spec, t.plan)]
    return [Phase.CANARY_STARTING, *gates, Phase.LATENCY_ANALYSIS]


def advance(t: Tick) -> None:
    """Enter the phase after the current one. Its work starts with the next pass, on observations made for it."""
    sequence = _gate_sequence(t)
    position = sequence.index(t.phase) if t.phase in sequence else len(sequence) - 1
    if position + 1 < len(sequence):
        following = sequence[position + 1]
        t.enter(following)
        gate = next((gate for gate in PHASE_GATES if gate.phase == following), None)
        if gate is not None:
            gate.set_result(t.status, GateResult(verdict=GateVerdict.RUNNING, job=t.job(gate)))
        else:
            t.status.latency = LatencyAnalysis()
        t.requeue = 0
        return
    if not approved(t):
        t.enter(Phase.AWAITING_APPROVAL)
        rollout = t.status.rollout_id
        t.event(
            "Normal",
            Reason.AWAITING_APPROVAL,
            f"all gates passed; approve rollout {rollout} to promote: kubectl kvpolicy approve {t.ref.name} "
            f"(sets spec.rollout.approvedRollout to {rollout})",
        )
        if t.spec.rollout.approved:
            t.event(
                "Warning",
                Reason.DEPRECATED_APPROVAL,
                "spec.rollout.approved no longer approves (it would approve every later rollout too): set "
                f"spec.rollout.approvedRollout to {rollout} and remove spec.rollout.approved",
            )
        t.requeue = t.config.idle_seconds
        return
    start_promotion(t)


def approved(t: Tick) -> bool:
    """Automatic approval, or a Manual one naming this rollout: an approval never carries over to another."""
    rollout = t.spec.rollout
    return rollout.approval == Approval.AUTOMATIC or (
        rollout.approved_rollout is not None and rollout.approved_rollout == t.status.rollout_id
    )


def start_promotion(t: Tick) -> None:
    t.enter(Phase.PROMOTING)
    if t.advisory:
        message = f"gates passed: publishing the FP8 KV change for {t.spec.target_ref.name} (applyMode Advisory)"
    else:
        message = f"gates passed: promoting {t.spec.target_ref.name} to FP8 KV"
    t.event("Normal", Reason.PROMOTING, message)
    t.requeue = 0


def watch_capacity(t: Tick) -> str | None:
    """Report pods the scheduler cannot place; the scheduler's message while some are unschedulable."""
    unschedulable = [pod for pod in t.obs.canary_pods if pod.unschedulable]
    if unschedulable:
        message = f"canary pod {unschedulable[0].name} cannot be scheduled: {unschedulable[0].unschedulable}"
        if t.condition(ConditionType.CAPACITY_AVAILABLE, ConditionStatus.FALSE, Reason.UNSCHEDULABLE, message):
            t.event("Warning", Reason.CANARY_UNSCHEDULABLE, message)
        return unschedulable[0].unschedulable
    return None


def deadline_rollback(t: Tick, unschedulable: str | None, waiting_for: str) -> bool:
    """Roll back once the phase has waited `progressDeadlineSeconds`; `unschedulable` is the scheduler's message."""
    deadline = t.spec.rollout.progress_deadline_seconds
    if t.phase_age() <= deadline:
        return False
    if unschedulable is not None:
        reason = DecisionReason.CAPACITY_UNAVAILABLE
        message = f"{waiting_for} not ready within {deadline} s: no capacity for its pods ({unschedulable})"
    else:
        reason = DecisionReason.PROGRESS_DEADLINE_EXCEEDED
        message = f"{waiting_for} not ready within {deadline} s"
    t.condition(ConditionType.CANARY_READY, ConditionStatus.FALSE, reason, message)
    rollback(t, reason, message)
    return True


def run_job(t: Tick, gate: JobGate) -> GateResult | None:
    """A Job gate's record once its Job has finished or timed out; None while it runs. Creates the Job if missing.

    A Job whose pod cannot start (an image it cannot pull, a missing Secret, no node for it) says so in the gate's
    condition at once, and fails past `progressDeadlineSeconds`, well before the gate's own timeout."""
    job = gate.build(t.job_inputs(gate))
    view = t.obs.jobs.get(job.name)
    if view is None:
        t.add(Create(Kind.JOB, b.gate_job(t.ref, job)))
    if view is not None and not view.finished and view.not_starting is not None:
        message = f"gate Job {job.name} cannot start: {view.not_starting}"
        if t.condition(gate.condition, ConditionStatus.UNKNOWN, Reason.GATE_POD_NOT_STARTING, message):
            t.event("Warning", Reason.GATE_POD_NOT_STARTING, message)
        deadline = t.spec.rollout.progress_deadline_seconds
        if t.phase_age() > deadline:
            t.add(Delete(Kind.JOB, job.name))
            never_started = JobView(job.name, failed=True, failure_reason=f"not started in {deadline} s: {message}")
            return _recorded(t, gate, never_started, job.name)
    if view is None or not view.finished:
        if t.phase_age() <= gate.deadline_seconds(t.spec):
            return None
        t.add(Delete(Kind.JOB, job.name))
        result = gate.timed_out(t.spec)
        result.job = job.name
        return result
    return _recorded(t, gate, view, job.name)


def _recorded(t: Tick, gate: JobGate, view: JobView, job: str) -> GateResult:
    result = gate.record(t.spec, view, read_report(view.termination_message))
    result.finished_at = timestamp(t.now)
    result.job = job
    return result
