"""The one place that sets and looks up a `metav1.Condition` in a status's list (the step, the reconciler, the
kubectl plugin), and that reads one of another object's (a pod's, a target's) as the API gives it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kvpolicy.analysis.checks import CheckVerdict, Transition
from kvpolicy.api.v1alpha1 import Condition, ConditionStatus, ConditionType, KVPolicyStatus


def set_condition(
    conditions: list[Condition],
    type_: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str,
    now: datetime,
    generation: int,
) -> Condition | None:
    """Set one condition in place; its lastTransitionTime moves only when its status does. Returns the condition it
    replaced (None: there was none)."""
    for index, existing in enumerate(conditions):
        if existing.type == type_:
            moved = existing.status != status
            conditions[index] = Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now if moved else existing.last_transition_time,
                observed_generation=generation,
            )
            return existing
    conditions.append(
        Condition(
            type=type_,
            status=status,
            reason=reason,
            message=message,
            last_transition_time=now,
            observed_generation=generation,
        )
    )
    return None


def find_condition(conditions: Sequence[Condition], type_: ConditionType) -> Condition | None:
    return next((condition for condition in conditions if condition.type == type_), None)


def transition(before: KVPolicyStatus, after: KVPolicyStatus, observed: Sequence[CheckVerdict] = ()) -> Transition:
    """One pass as the gates read it (`Gate.outcomes`), with the statuses of both statuses' conditions."""

    def statuses(conditions: Sequence[Condition]) -> dict[str, str]:
        return {condition.type: condition.status for condition in conditions}

    return Transition(before, after, statuses(before.conditions), statuses(after.conditions), tuple(observed))


def condition_holds(
    conditions: Sequence[Condition], type_: ConditionType, status: ConditionStatus = ConditionStatus.TRUE
) -> bool:
    """Whether the condition of this type is set, with this status."""
    found = find_condition(conditions, type_)
    return found is not None and found.status == status


def object_condition(obj: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    """The condition of this type in another object's status (a pod's `Ready`, a target's), as the API gives it."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((condition for condition in conditions if condition.get("type") == type_), None)
