"""The Job gates, one module each, and their registry: the order they run in.

The registry finds its gates itself: every `JobGate` that a module of this package defines, ordered as the API
orders their phases (`GATE_PHASES` in api/v1alpha1.py; a gate that judges inside another phase, like the latency
probe inside LatencyAnalysis, comes after them). The step, the observer, the deadlines, the reconciler's
gate-results metric and `kubectl kvpolicy` read the registry, never a gate by name.

Adding a gate is three files:
1. `rollout/gates/<gate>.py`: its `JobGate` (job.py has the contract: when it runs, its Job, its deadline, how its
   `GateReport` becomes a `GateResult`, how that result moves the rollout; preflight.py is an example). Nothing
   else in this package changes: the registry finds it.
2. `api/v1alpha1.py`: its `Phase`, listed in `GATE_PHASES` where it runs; its `ConditionType`; its spec (a field of
   `GatesSpec`) and status (a `GateResult` field of `KVPolicyStatus`); then regenerate the CRD (`make generate`).
3. `api/reasons.py`: the reasons its records, conditions, events and decisions say (`Reason`, `DecisionReason`).
tests/rollout/test_rollout_gate_registry.py checks that the registry and the API stay in step (one gate per gate
phase, distinct names and conditions, every reason a gate says a member of api/reasons.py) and that every gate's
result reaches kvpolicy_gate_results_total. A gate whose Job runs a new program also adds it in gate_programs/; a gate
the planner decides on names itself in `plan.gates` (planning/planner.py).

The metrics checks are the other kind of gate (`GateKind.METRICS`; `GateKind.JOB` here): rollout/metric_checks.py.
Both are a `Gate` (analysis/checks.py) and speak one verdict vocabulary, `AnalysisPhase` (api/v1alpha1.py);
rollout/gate_registry.py lists every gate of a policy."""

from __future__ import annotations

import importlib
import pkgutil

from kvpolicy.api.v1alpha1 import GATE_PHASES, GateResult, KVPolicyStatus, Phase
from kvpolicy.rollout.gates.job import JobGate


def _order(gate: JobGate) -> tuple[int, str]:
    """A gate of its own phase runs where `GATE_PHASES` puts it; the others follow, by name."""
    return (GATE_PHASES.index(gate.phase) if gate.phase in GATE_PHASES else len(GATE_PHASES), gate.name)


def _find_gates() -> tuple[JobGate, ...]:
    """Every `JobGate` a module of this package defines (once, should a module import another's)."""
    found: dict[int, JobGate] = {}
    for module in pkgutil.iter_modules(__path__):
        for value in vars(importlib.import_module(f"{__name__}.{module.name}")).values():
            if isinstance(value, JobGate):
                found[id(value)] = value
    return tuple(sorted(found.values(), key=_order))


# Every Job gate, in the order they run.
JOB_GATES: tuple[JobGate, ...] = _find_gates()
# The gates with a phase of their own (GATE_PHASES), in the order they run.
PHASE_GATES: tuple[JobGate, ...] = tuple(gate for gate in JOB_GATES if gate.phase in GATE_PHASES)
GATE_OF_PHASE: dict[Phase, JobGate] = {gate.phase: gate for gate in PHASE_GATES}


def finished_gates(before: KVPolicyStatus, after: KVPolicyStatus) -> list[tuple[JobGate, GateResult]]:
    """The gates whose result turned from absent or Running into a verdict between two statuses, each once: what
    the gate-results metric counts (`JobGate.finished`)."""
    return [(gate, record) for gate in JOB_GATES if (record := gate.finished(before, after)) is not None]
