"""The one condition lookup (rollout/conditions.py) the step, its rules and the kubectl plugin share."""

from kvpolicy.api.v1alpha1 import Condition, ConditionStatus, ConditionType
from kvpolicy.rollout.conditions import condition_holds, find_condition, set_condition

NOW = "2026-12-02T04:00:00Z"


def test_a_condition_holds_only_with_its_type_and_status() -> None:
    conditions: list[Condition] = []
    assert not condition_holds(conditions, ConditionType.PAUSED)
    set_condition(conditions, ConditionType.PAUSED, ConditionStatus.FALSE, "Resumed", "", NOW, 1)
    set_condition(conditions, ConditionType.DRIFTED, ConditionStatus.TRUE, "TargetChanged", "", NOW, 1)
    assert not condition_holds(conditions, ConditionType.PAUSED)
    assert condition_holds(conditions, ConditionType.PAUSED, ConditionStatus.FALSE)
    assert condition_holds(conditions, ConditionType.DRIFTED)
    found = find_condition(conditions, ConditionType.DRIFTED)
    assert found is not None and found.reason == "TargetChanged"
    assert find_condition(conditions, ConditionType.LATENCY_GATE_PASSED) is None
