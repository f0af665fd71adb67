"""What every gate is (`Gate`), and the metrics checks, one table entry each.

A gate, after Argo Rollouts' metric providers (its `Provider` interface, of which a Job is one provider and
Prometheus another): a name (the `gate` label of kvpolicy_gate_results_total), the kind of provider that measures it
(`GateKind`: a Job's report, or the policy's metrics provider), and the results one pass of the step took from it
(`outcomes`: what the gate-results metric counts). Every gate says its verdict in one vocabulary, `GateVerdict`, whose
`.phase` is Argo's `AnalysisPhase` (api/v1alpha1.py). The Job gates are `JobGate`s (rollout/gates/), the metrics
checks `MetricsCheck`s (below); rollout/gate_registry.py lists them all for a policy.

A metrics check: what it reads through the metrics provider, the pure assessor that turns the reading into a typed
`Verdict`, and the `Stage` that says how the rollout reacts to it. The observer runs every entry that is due the same
way, and the step reacts to each verdict by its entry's stage alone, so a new check is its reader/assessor module, its
line in the table (rollout/metric_checks.py), and its reason codes (api/reasons.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum, StrEnum, auto
from typing import Any, Generic, Protocol, TypeVar

from kvpolicy.analysis.model import ProviderUnavailableError, SideSelector, Verdict
from kvpolicy.analysis.provider import MetricsProvider
from kvpolicy.api.reasons import Reason
from kvpolicy.api.v1alpha1 import (
    AnalysisPhase,
    ConditionStatus,
    ConditionType,
    GateResult,
    GateVerdict,
    KVPolicy,
    KVPolicySpec,
    KVPolicyStatus,
)

Reading = TypeVar("Reading")

# ---------------------------------------------------------------------------------------------------- every gate


class GateKind(StrEnum):
    """What measures a gate (Argo Rollouts' provider type)."""

    JOB = "Job"  # a Job the operator runs, whose report becomes a status record (rollout/gates/)
    METRICS = "Metrics"  # the policy's metrics provider, read by the observer (a `MetricsCheck`)


@dataclass(frozen=True)
class GateOutcome:
    """One gate result a pass took: kvpolicy_gate_results_total{gate, verdict} counts it. A Job gate's carries its
    status record, whose recovery and scores (beside the gate's least recovery) the per-policy gate gauges publish."""

    gate: str
    verdict: GateVerdict
    record: GateResult | None = None
    min_recovery: float | None = None


@dataclass(frozen=True)
class Transition:
    """One pass of the step as the gates read it: the status before and after, the statuses of their conditions by
    type (read through rollout/conditions.py `transition`, the one condition lookup), and the metrics checks'
    verdicts observed for it."""

    before: KVPolicyStatus
    after: KVPolicyStatus
    conditions_before: Mapping[str, str]  # a condition's status by its type
    conditions_after: Mapping[str, str]
    observed: Sequence[CheckVerdict] = ()


class Gate(Protocol):
    """Every gate, Job gate and metrics check alike: the registry's one shape (rollout/gate_registry.py)."""

    @property
    def name(self) -> str:
        """The `gate` label of kvpolicy_gate_results_total (the alert rules match on it)."""
        ...

    @property
    def kind(self) -> GateKind: ...

    def outcomes(self, spec: KVPolicySpec, change: Transition) -> list[GateOutcome]:
        """The results of this gate that this pass took, each counted once."""
        ...


# ------------------------------------------------------------------------------------------------ metrics checks


class Stage(Enum):
    """When a check runs and how the step reacts to its verdict."""

    # Once, on the ready canary before any gate: Pass records its evidence and sets the entry's condition, Breach
    # rolls back with the verdict's reason, NoData/ProviderUnavailable wait up to rollout.progressDeadlineSeconds.
    VERIFY = auto()
    # Every gates.latency.intervalSeconds of the live latency analysis: the verdicts of all such entries are folded
    # into one check (`combine`), which counts towards the bake, the breach streak or the inconclusive stall.
    ANALYSIS = auto()


@dataclass(frozen=True)
class Sides:
    """The two sides a check compares: the canary's ready pods and the target's own (the baseline), over the last
    `window_seconds` (gates.latency.windowSeconds, cut to the time since the canary joined the traffic)."""

    canary: SideSelector
    baseline: SideSelector
    window_seconds: int


@dataclass(frozen=True)
class Verification:
    """How a VERIFY entry shows in status: its condition, and the words of its waiting and deadline messages."""

    condition: ConditionType
    passed_event: Reason  # the Normal event's reason once verified
    waiting_reason: Reason  # the condition's reason while the reading is missing
    waiting: str  # "waiting for <what>: <verdict message>"
    unverified: str  # "<what> could not be verified within N s: <verdict message>"


@dataclass(frozen=True)
class MetricsCheck(Generic[Reading]):
    """One metrics check: `read` asks the provider (raising ProviderUnavailableError when it cannot answer), `assess`
    judges the reading against the policy (pure)."""

    name: str
    stage: Stage
    read: Callable[[MetricsProvider, KVPolicy, Sides], Awaitable[Reading]]
    assess: Callable[[KVPolicy, Reading], Verdict]
    verification: Verification | None = None  # VERIFY entries only
    reads_baseline: bool = False  # a VERIFY entry that also reads the target's own pods (ANALYSIS entries always do)

    @property
    def kind(self) -> GateKind:
        return GateKind.METRICS

    def took(self, verdict: Verdict, change: Transition) -> bool:
        """Whether the step took this check's verdict in this pass. An ANALYSIS check's counts when the analysis
        folded this pass's check in (every one is a measurement); a VERIFY check's when it concluded the check (its
        condition turned True on a pass, False on a breach), not while it waits for data."""
        if self.stage is Stage.ANALYSIS:
            before, after = change.before.latency, change.after.latency
            return after is not None and after.checks > (before.checks if before else 0)
        concluded = _CONCLUDED.get(verdict.phase)
        if self.verification is None or concluded is None:
            return False
        condition = self.verification.condition
        now, then = change.conditions_after.get(condition), change.conditions_before.get(condition)
        return now == concluded and then != concluded

    def outcomes(self, spec: KVPolicySpec, change: Transition) -> list[GateOutcome]:
        """This check's verdict observed for the pass, when the step took it (`took`). A check is known by its name:
        the policy's checks have unique names (the custom ones are built anew for each pass)."""
        return [
            GateOutcome(self.name, result.verdict.kind)
            for result in change.observed
            if result.check.name == self.name and self.took(result.verdict, change)
        ]

    async def evaluate(self, provider: MetricsProvider, policy: KVPolicy, sides: Sides) -> Verdict:
        """Read and assess; an unavailable provider is a ProviderUnavailable verdict, never an exception."""
        try:
            reading = await self.read(provider, policy, sides)
        except ProviderUnavailableError as error:
            return Verdict.provider_unavailable(error)
        return self.assess(policy, reading)


AnyCheck = MetricsCheck[Any]

# The condition status a VERIFY check's conclusive verdict sets.
_CONCLUDED = {AnalysisPhase.SUCCESSFUL: ConditionStatus.TRUE, AnalysisPhase.FAILED: ConditionStatus.FALSE}


@dataclass(frozen=True)
class CheckVerdict:
    """What one entry said in one observation."""

    check: AnyCheck
    verdict: Verdict


# Which verdict speaks for several checks made together: any failure (a breach), then any that could not measure (an
# unavailable provider), then any inconclusive one (no data), else a pass.
_PRECEDENCE = (AnalysisPhase.FAILED, AnalysisPhase.ERROR, AnalysisPhase.INCONCLUSIVE, AnalysisPhase.SUCCESSFUL)


def combine(verdicts: Sequence[Verdict]) -> Verdict:
    """One verdict for checks made together: the first of the most severe phase, with the messages of every verdict
    of that phase and the figures of all of them. A single verdict is returned unchanged."""
    if len(verdicts) == 1:
        return verdicts[0]
    if not verdicts:
        raise ValueError("combine: no verdicts")
    phase = next(phase for phase in _PRECEDENCE if any(verdict.phase is phase for verdict in verdicts))
    speaking = [verdict for verdict in verdicts if verdict.phase is phase]
    first = speaking[0]
    with_sides = next((verdict for verdict in verdicts if verdict.canary is not None), first)
    return replace(
        first,
        message="; ".join(verdict.message for verdict in speaking),
        checks=tuple(check for verdict in verdicts for check in verdict.checks),
        mean_checks=tuple(check for verdict in verdicts for check in verdict.mean_checks),
        values={key: value for verdict in verdicts for key, value in verdict.values.items()},
        canary=with_sides.canary,
        baseline=with_sides.baseline,
        needs_attention=any(verdict.needs_attention for verdict in speaking),
    )
