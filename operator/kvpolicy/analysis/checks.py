"""Metrics checks, one table entry each (like the Job gates in rollout/gates/): what a check reads through the
metrics provider, the pure assessor that turns the reading into a typed `Verdict`, and the `Stage` that says how the
rollout reacts to it. The observer runs every entry that is due the same way, and the step reacts to each verdict by
its entry's stage alone, so a new check is its reader/assessor module, its line in the table
(rollout/metric_checks.py), and its reason codes (api/reasons.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum, auto
from typing import Any, Generic, TypeVar

from kvpolicy.analysis.model import ProviderUnavailableError, SideSelector, Verdict
from kvpolicy.analysis.provider import MetricsProvider
from kvpolicy.api.reasons import Reason
from kvpolicy.api.v1alpha1 import AnalysisPhase, ConditionType, KVPolicy

Reading = TypeVar("Reading")


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

    async def evaluate(self, provider: MetricsProvider, policy: KVPolicy, sides: Sides) -> Verdict:
        """Read and assess; an unavailable provider is a ProviderUnavailable verdict, never an exception."""
        try:
            reading = await self.read(provider, policy, sides)
        except ProviderUnavailableError as error:
            return Verdict.provider_unavailable(error)
        return self.assess(policy, reading)


AnyCheck = MetricsCheck[Any]


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
