"""The metrics checks, one table entry each (analysis/checks.py has the contract): the canary configuration check, the
TTFT/ITL comparison, and the policy's custom checks built from spec.analysis.checks. They are the gates of kind
Metrics, as rollout/gates/ holds those of kind Job: rollout/gate_registry.py lists both for a policy.

The observer evaluates every entry that is due (`check_due`) through the policy's metrics provider; the step reacts
to each verdict by its entry's `Stage` alone. Adding a check: its reader/assessor module (with its `MetricsCheck`), its
line in `METRICS_CHECKS`, and its reason codes in api/reasons.py (a VERIFY check also names its condition type in
api/v1alpha1.py).

Pure: nothing here reads the cluster or the state machine, so observe and the step can both use the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from kvpolicy.analysis.checks import AnyCheck, CheckVerdict, MetricsCheck, Sides, Stage
from kvpolicy.analysis.custom import custom_checks
from kvpolicy.analysis.latency_check import latency_snapshots
from kvpolicy.analysis.model import SideMetrics, Verdict
from kvpolicy.analysis.provider import MetricsProvider
from kvpolicy.analysis.served import CANARY_CONFIG
from kvpolicy.analysis.verdicts import assess
from kvpolicy.api.v1alpha1 import KVPolicy, KVPolicyStatus, Phase
from kvpolicy.rollout.conditions import condition_holds, transition
from kvpolicy.rollout.rules import latency_check_due, latency_gate_config


async def _read_latency(provider: MetricsProvider, policy: KVPolicy, sides: Sides) -> tuple[SideMetrics, SideMetrics]:
    config = replace(latency_gate_config(policy.spec), window_seconds=sides.window_seconds)
    return await latency_snapshots(provider, config, sides.canary, sides.baseline)


def _assess_latency(policy: KVPolicy, measured: tuple[SideMetrics, SideMetrics]) -> Verdict:
    return assess(latency_gate_config(policy.spec), *measured)


LATENCY: MetricsCheck[tuple[SideMetrics, SideMetrics]] = MetricsCheck(
    name="latency", stage=Stage.ANALYSIS, read=_read_latency, assess=_assess_latency
)

# In the order they are evaluated (and, for ANALYSIS entries, the order their verdicts speak in when combined).
METRICS_CHECKS: tuple[AnyCheck, ...] = (CANARY_CONFIG, LATENCY)


def checks_for(policy: KVPolicy) -> tuple[AnyCheck, ...]:
    """Every check of this policy: the table's, then its custom checks."""
    return (*METRICS_CHECKS, *custom_checks(policy))


def check_due(check: AnyCheck, policy: KVPolicy, canary_ready: bool, now: datetime) -> bool:
    """Whether observe must evaluate this check for this step. VERIFY: the canary has a ready pod and the check's
    condition is not True yet. ANALYSIS: a latency analysis check is due (rules.latency_check_due)."""
    if check.stage is Stage.ANALYSIS:
        return latency_check_due(policy, now)
    status = policy.status
    verification = check.verification
    if verification is None or status.phase != Phase.CANARY_STARTING or not canary_ready:
        return False
    return not condition_holds(status.conditions, verification.condition)


def needs_baseline(checks: Sequence[AnyCheck]) -> bool:
    """An ANALYSIS check compares the canary with the target's pods, and so does a VERIFY check that says so (the
    canary configuration check's parity)."""
    return any(check.stage is Stage.ANALYSIS or check.reads_baseline for check in checks)


def taken_checks(before: KVPolicyStatus, after: KVPolicyStatus, checks: Sequence[CheckVerdict]) -> list[CheckVerdict]:
    """The verdicts of this pass's metrics checks that the step took, each once (`MetricsCheck.took`): what the
    gate-results metric counts, as it counts a Job gate's record once it is final (`gates.finished_gates`)."""
    change = transition(before, after, checks)
    return [result for result in checks if result.check.took(result.verdict, change)]
