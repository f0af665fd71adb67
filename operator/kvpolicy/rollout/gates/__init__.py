"""The Job gates, one module each, and their registry: the order they run in. Adding a gate is three files: its
module here (a `JobGate`: how its Job is built, how its report becomes a status record and how that record moves the
rollout; job.py has the contract), its line below, and in api/ its spec and status fields, its `Phase` and condition
type (v1alpha1.py) and its reasons (reasons.py). The step, the observer, the reconciler's gate-results metric and
`kubectl kvpolicy` read the registry, never a gate by name.

The metrics checks are the other kind of gate (after Argo Rollouts' Prometheus provider, where these are its job
provider): rollout/metric_checks.py. Both speak one verdict vocabulary, `AnalysisPhase` (api/v1alpha1.py)."""

from __future__ import annotations

from kvpolicy.api.v1alpha1 import AnalysisPhase, GateResult, KVPolicyStatus
from kvpolicy.rollout.gates.accuracy import ACCURACY
from kvpolicy.rollout.gates.job import JobGate
from kvpolicy.rollout.gates.latency_probe import LATENCY_PROBE
from kvpolicy.rollout.gates.preflight import GPU_PREFLIGHT

# The gates with a phase of their own, in the order they run (between CanaryStarting and LatencyAnalysis).
PHASE_GATES: tuple[JobGate, ...] = (GPU_PREFLIGHT, ACCURACY)
# Synthetic traffic: the latency probe Job judges the canary inside the LatencyAnalysis phase.
JOB_GATES: tuple[JobGate, ...] = (*PHASE_GATES, LATENCY_PROBE)
GATE_OF_PHASE = {gate.phase: gate for gate in PHASE_GATES}


def finished_gates(before: KVPolicyStatus, after: KVPolicyStatus) -> list[tuple[JobGate, GateResult]]:
    """The gates whose result turned from absent or Running into a verdict between two statuses, each once: what
    the gate-results metric counts."""
    finished = []
    for gate in JOB_GATES:
        old, new = gate.result(before), gate.result(after)
        running = AnalysisPhase.RUNNING
        if new is not None and new.verdict.phase is not running and (old is None or old.verdict.phase is running):
            finished.append((gate, new))
    return finished
