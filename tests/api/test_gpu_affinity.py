"""Required node affinity decides which GPUs a target's pods may land on (Karpenter, GKE and EKS node pools)."""

from __future__ import annotations

from typing import Any

import pytest
from kvpolicy.planning.gpu import required_affinity_admits


def _affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def _expression(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


POOL = "karpenter.sh/nodepool"
B200 = {POOL: "b200", "nvidia.com/gpu.count": "8"}
H200 = {POOL: "h200", "nvidia.com/gpu.count": "8"}


@pytest.mark.parametrize(
    ("affinity", "labels", "admitted"),
    [
        (None, H200, True),
        ({}, H200, True),
        ({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}, H200, True),
        (_affinity({"matchExpressions": [_expression(POOL, "In", "b200")]}), B200, True),
        (_affinity({"matchExpressions": [_expression(POOL, "In", "b200")]}), H200, False),
        (_affinity({"matchExpressions": [_expression(POOL, "NotIn", "b200")]}), H200, True),
        (_affinity({"matchExpressions": [_expression(POOL, "NotIn", "b200")]}), {}, True),
        (_affinity({"matchExpressions": [_expression(POOL, "Exists")]}), {}, False),
        (_affinity({"matchExpressions": [_expression(POOL, "DoesNotExist")]}), {}, True),
        (_affinity({"matchExpressions": [_expression("nvidia.com/gpu.count", "Gt", "4")]}), B200, True),
        (_affinity({"matchExpressions": [_expression("nvidia.com/gpu.count", "Lt", "4")]}), B200, False),
        (_affinity({"matchExpressions": [_expression("nvidia.com/gpu.count", "Gt", "many")]}), B200, False),
        # terms are ORed, expressions within a term ANDed
        (
            _affinity(
                {"matchExpressions": [_expression(POOL, "In", "a100")]},
                {"matchExpressions": [_expression(POOL, "In", "b200"), _expression(POOL, "Exists")]},
            ),
            B200,
            True,
        ),
        (
            _affinity({"matchExpressions": [_expression(POOL, "In", "b200"), _expression(POOL, "NotIn", "b200")]}),
            B200,
            False,
        ),
        (_affinity({}), B200, False),  # an empty term matches no node, as in the scheduler
    ],
)
def test_required_node_affinity(affinity: dict[str, Any] | None, labels: dict[str, str], admitted: bool) -> None:
    assert required_affinity_admits("node-1", labels, affinity) is admitted


def test_match_fields_select_by_node_name() -> None:
    affinity = _affinity({"matchFields": [_expression("metadata.name", "In", "gpu-7")]})
    assert required_affinity_admits("gpu-7", {}, affinity)
    assert not required_affinity_admits("gpu-8", {}, affinity)
