"""The gate registry (rollout/gates/__init__.py) and the API stay in step, so that adding a gate is three files (its
module in rollout/gates/, its API in api/v1alpha1.py, its reasons in api/reasons.py): every gate phase the API
declares has one registered gate, in the API's order; the gates' names, conditions and status records are their own;
and every reason a gate says, in its records, conditions, events and decisions, is a member of api/reasons.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvpolicy.analysis.checks import GateKind
from kvpolicy.api.reasons import ALL_REASONS, GateReason
from kvpolicy.api.v1alpha1 import (
    GATE_PHASES,
    JOB_VERDICTS,
    GateResult,
    GateVerdict,
    KVPolicyStatus,
    LatencyAnalysis,
    Phase,
    Plan,
)
from kvpolicy.gate_programs.report import GateReport
from kvpolicy.rollout import gates
from kvpolicy.rollout.gate_registry import gates_for
from kvpolicy.rollout.gates import GATE_OF_PHASE, JOB_GATES, PHASE_GATES
from kvpolicy.rollout.gates.job import JobGate
from kvpolicy.rollout.metric_checks import METRICS_CHECKS
from kvpolicy.rollout.step_types import JobView
from operator_helpers import make_policy

SPEC = make_policy(**{"gates.gpuPreflight.enabled": True}).spec
FINISHED = [verdict for verdict in JOB_VERDICTS if verdict is not GateVerdict.RUNNING]


def test_every_gate_phase_of_the_api_has_one_registered_gate_in_the_apis_order() -> None:
    assert [gate.phase for gate in PHASE_GATES] == list(GATE_PHASES)
    assert set(GATE_OF_PHASE) == set(GATE_PHASES)
    # A gate without a phase of its own judges inside the latency analysis (the latency probe), after the others.
    others = [gate for gate in JOB_GATES if gate.phase not in GATE_PHASES]
    assert (*PHASE_GATES, *others) == JOB_GATES
    assert all(gate.phase is Phase.LATENCY_ANALYSIS for gate in others)
    assert list(Phase).index(GATE_PHASES[0]) > list(Phase).index(Phase.CANARY_STARTING)
    assert list(Phase).index(GATE_PHASES[-1]) < list(Phase).index(Phase.LATENCY_ANALYSIS)


def test_the_registry_finds_a_new_gate_module_without_a_line_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module that defines a gate is all the registry needs (step 1 of the recipe); a gate without a phase of its
    own comes after those with one, by name. A module importing another's gate does not register it twice."""
    (tmp_path / "smoke.py").write_text(
        "from dataclasses import replace\n"
        "from kvpolicy.rollout.gates.latency_probe import LATENCY_PROBE\n"
        'SMOKE = replace(LATENCY_PROBE, name="smoke", label="Smoke")\n'
    )
    monkeypatch.setattr(gates, "__path__", [*gates.__path__, str(tmp_path)])
    try:
        found = gates._find_gates()
    finally:
        sys.modules.pop("kvpolicy.rollout.gates.smoke", None)
        vars(gates).pop("smoke", None)
    assert [gate.name for gate in found] == [*(gate.name for gate in JOB_GATES), "smoke"]


def test_each_gate_has_its_own_name_condition_and_status_record() -> None:
    assert len({gate.name for gate in JOB_GATES}) == len(JOB_GATES)
    assert len({gate.label for gate in JOB_GATES}) == len(JOB_GATES)
    assert len({gate.condition for gate in JOB_GATES}) == len(JOB_GATES)
    for gate in JOB_GATES:
        status = KVPolicyStatus(latency=LatencyAnalysis())
        record = GateResult(verdict=GateVerdict.RUNNING, job=f"{gate.name}-job")
        gate.set_result(status, record)
        assert [other.name for other in JOB_GATES if other.result(status) is not None] == [gate.name]
        assert gate.result(status) == record


def test_both_kinds_of_gate_are_in_one_registry() -> None:
    policy = make_policy()
    registry = gates_for(policy)
    assert [gate.name for gate in registry] == [*(gate.name for gate in JOB_GATES), *(c.name for c in METRICS_CHECKS)]
    assert {gate.kind for gate in registry} == set(GateKind)
    assert all(gate.kind is GateKind.JOB for gate in JOB_GATES)


def _records(gate: JobGate) -> list[GateResult]:
    """Every kind of record the gate makes: from a report of each verdict, from a Job that left none, on its
    deadline, and without a Job (a plan it cannot run on)."""
    view = JobView(name=f"{gate.name}-job", succeeded=True, exit_code=0)
    reports = [GateReport(verdict=v, reason=GateReason.RECOVERY_ABOVE_THRESHOLD, message="m") for v in FINISHED]
    reports.append(GateReport.problem(GateReason.REPORT_MISSING, "no report"))
    records = [gate.record(SPEC, view, report) for report in reports]
    records.append(gate.timed_out(SPEC))
    for backend in (None, "FLASHINFER", "NOT-A-BACKEND"):
        skipped = gate.skip(Plan(kv_cache_dtype="FP8", vllm_kv_cache_dtype="fp8", attention_backend=backend))
        records += [skipped] if skipped is not None else []
    return records


def _said(gate: JobGate, record: GateResult) -> set[str]:
    """The reasons a record says, and those its judgement says (condition, event, decision)."""
    judgement = gate.judge(SPEC, record)
    event = judgement.event
    return {str(record.reason), judgement.reason, judgement.decided.reason, *([event.reason] if event else [])}


def test_every_reason_a_gate_says_is_a_member_of_the_reasons_module() -> None:
    for gate in JOB_GATES:
        said = {reason for record in _records(gate) for reason in _said(gate, record)}
        assert said - ALL_REASONS == set(), gate.name
