"""The phases of the Job gates that hold the rollout on their own (GPU preflight, accuracy): run the gate's Job, record
its report, and move on as its judgement says."""

from __future__ import annotations

from kvpolicy.rollout.gates.job import JobGate, Then
from kvpolicy.rollout.tick import Tick, advance, rollback, run_job


def job_gate_phase(t: Tick, gate: JobGate) -> None:
    result = gate.skip(t.plan) or run_job(t, gate)
    if result is None:
        return
    gate.set_result(t.status, result)
    judgement = gate.judge(t.spec, result)
    t.condition(gate.condition, judgement.status, judgement.reason, judgement.message)
    if judgement.event is not None:
        t.event(judgement.event.type, judgement.event.reason, judgement.event.message)
    if judgement.then == Then.ROLLBACK:
        rollback(t, judgement.decided.reason, judgement.decided.message)
    else:
        advance(t)
