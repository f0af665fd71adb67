"""Every gate of a policy, in one registry of one shape (`Gate`, analysis/checks.py; after Argo Rollouts' metric
providers, where a Job is one provider among others): its Job gates (rollout/gates/, in the order they run), then
its metrics checks (rollout/metric_checks.py's table, then the policy's custom checks).

The reconciler's gate-results metric reads every entry the same way (`gate_outcomes`); the step and the observer
read the two kinds' own views of it (the phase gates in `gates.PHASE_GATES`, the checks due in `checks_for`).

Pure: nothing here reads the cluster."""

from __future__ import annotations

from collections.abc import Sequence

from kvpolicy.analysis.checks import CheckVerdict, Gate, GateOutcome
from kvpolicy.api.v1alpha1 import KVPolicy, KVPolicyStatus
from kvpolicy.rollout.conditions import transition
from kvpolicy.rollout.gates import JOB_GATES
from kvpolicy.rollout.metric_checks import checks_for


def gates_for(policy: KVPolicy) -> tuple[Gate, ...]:
    return (*JOB_GATES, *checks_for(policy))


def gate_outcomes(policy: KVPolicy, after: KVPolicyStatus, observed: Sequence[CheckVerdict]) -> list[GateOutcome]:
    """The results every gate of the policy took in a pass from its status to `after`, with the metrics checks'
    verdicts `observed` for it, each once: what kvpolicy_gate_results_total counts."""
    change = transition(policy.status, after, observed)
    return [outcome for gate in gates_for(policy) for outcome in gate.outcomes(policy.spec, change)]
