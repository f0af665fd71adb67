"""The decision table: one row per KVPolicy, every cell read from the policy's status as the operator wrote it."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

from kvpolicy.api.v1alpha1 import KVPolicy, KVPolicyStatus, LatencyCheck

MISSING = "-"
HEADERS = ("policy", "GPU", "plan", "NIAH canary/baseline", "TTFT ratio", "ITL ratio", "decision", "reason")
_RATIO_KEY = re.compile(r"^(?P<metric>ttft|itl)[_:]", re.IGNORECASE)


@dataclass(frozen=True)
class DecisionRow:
    policy: str
    gpu: str
    plan: str
    niah: str
    ttft_ratio: str
    itl_ratio: str
    decision: str
    reason: str

    def cells(self) -> tuple[str, ...]:
        return tuple(str(value) for value in astuple(self))


def _gpu(status: KVPolicyStatus) -> str:
    if status.gpu is None:
        return MISSING
    product = status.gpu.sim_name
    generation = status.gpu.generation.value
    return f"{product.upper()} ({generation})" if product else generation


def _plan(status: KVPolicyStatus) -> str:
    plan = status.plan
    if plan is None:
        return MISSING
    text = plan.kv_cache_dtype.value
    if plan.skip_layers:
        text += f", {'+'.join(plan.skip_layers)} BF16"
    return text


def _niah(status: KVPolicyStatus) -> str:
    gate = status.accuracy
    if gate is None or gate.canary_score is None or gate.baseline_score is None:
        return MISSING
    return f"{gate.canary_score:.0%} / {gate.baseline_score:.0%}"


def worst_ratio(check: LatencyCheck | None, metric: str) -> float | None:
    """The largest canary/baseline ratio of one metric over the compared quantiles (the one a threshold binds)."""
    if check is None:
        return None
    values = [
        value
        for key, value in check.ratios.items()
        if (match := _RATIO_KEY.match(key)) and match.group("metric").lower() == metric
    ]
    return max(values) if values else None


def _ratio(status: KVPolicyStatus, metric: str) -> str:
    value = worst_ratio(status.latency.last if status.latency else None, metric)
    return MISSING if value is None else f"{value:.2f}"


def decision_row(policy: KVPolicy) -> DecisionRow:
    status = policy.status
    decision = status.decision
    return DecisionRow(
        policy=str(policy.metadata.get("name", MISSING)),
        gpu=_gpu(status),
        plan=_plan(status),
        niah=_niah(status),
        ttft_ratio=_ratio(status, "ttft"),
        itl_ratio=_ratio(status, "itl"),
        decision=decision.result if decision else (status.phase or "Pending"),
        reason=decision.reason if decision else MISSING,
    )


def decision_rows(objects: Sequence[Mapping[str, Any]]) -> list[DecisionRow]:
    """Rows for KVPolicy objects as the API returns them, in the order given."""
    return [decision_row(KVPolicy.model_validate(obj)) for obj in objects]


def render_text(rows: Sequence[DecisionRow]) -> str:
    """A plain-text table with aligned columns (no colour: it must read the same in a CI log)."""
    table = [HEADERS, *(row.cells() for row in rows)]
    widths = [max(len(line[column]) for line in table) for column in range(len(HEADERS))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(HEADERS), rule, *(line(row.cells()) for row in rows)])


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(rows: Sequence[DecisionRow]) -> str:
    header = "| " + " | ".join(HEADERS) + " |"
    rule = "|" + "|".join("---" for _ in fields(DecisionRow)) + "|"
    body = ["| " + " | ".join(_markdown_cell(cell) for cell in row.cells()) + " |" for row in rows]
    return "\n".join([header, rule, *body])
