from __future__ import annotations

from typing import Any

import pytest
from kvpolicy_dev.demo import scenarios


def policy_object(name: str, status: dict[str, Any]) -> dict[str, Any]:
    """A KVPolicy as the API would return it: a demo scenario's policy with the given status."""
    scenario = next(s for s in scenarios.SCENARIOS if s.name == name)
    return {**scenarios.kvpolicy(scenario, scenarios.DEMO_TIMING, prometheus_url=None), "status": status}


@pytest.fixture
def make_policy() -> Any:
    return policy_object
