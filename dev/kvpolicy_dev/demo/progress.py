"""Live progress: a line per KVPolicy with its phase, and a progress bar while a gate runs.

On a terminal the block of lines is redrawn in place; anywhere else (CI logs, pipes) a line is printed only when a
policy's phase or gate changes, so the log reads as a history instead of a flood.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from kvpolicy.api.v1alpha1 import GateVerdict, KVPolicy, Phase

BAR_WIDTH = 20
ACCURACY_PHASE = Phase.ACCURACY_GATE.value
LATENCY_PHASE = Phase.LATENCY_ANALYSIS.value
# Wide enough for every phase the operator writes, so lines printed at different times line up.
PHASE_WIDTH = max(len(phase.value) for phase in Phase)


@dataclass(frozen=True)
class PolicyProgress:
    name: str
    phase: str
    step: str  # what is happening now, without counts: changes of it are worth a log line
    detail: str  # the same with counts and numbers, for the live view
    fraction: float | None  # how far the running gate is, 0..1; None when no gate runs
    done: bool

    @property
    def milestone(self) -> tuple[str, str, bool]:
        return (self.phase, self.step, self.done)


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def policy_progress(policy: KVPolicy, now: datetime, gate_prompts: int | None = None) -> PolicyProgress:
    """Where one policy stands; `gate_prompts` is how many NIAH prompts the running accuracy gate has had answered
    (the operator learns the gate's sample count only when it ends)."""
    name = str(policy.metadata.get("name", "?"))
    status = policy.status
    phase = status.phase or "Pending"
    if status.decision is not None:
        decision = status.decision
        return PolicyProgress(name, phase, decision.result, f"{decision.result}: {decision.reason}", None, True)
    accuracy = status.accuracy
    if phase == ACCURACY_PHASE and accuracy is not None and accuracy.verdict == GateVerdict.RUNNING:
        limit = policy.spec.gates.accuracy.max_samples
        # A length profile sends each round's prompt at every bucket: the gate's length has a share of them.
        buckets = policy.spec.gates.accuracy.length_profile.buckets
        samples = gate_prompts // buckets if gate_prompts is not None else (accuracy.samples or 0)
        length = accuracy.length_tokens or policy.spec.capped_accuracy_length
        profile = f" (and {buckets - 1} shorter lengths)" if buckets > 1 else ""
        detail = f"accuracy gate: {samples}/{limit} NIAH prompts at {length:,} tokens{profile}"
        return PolicyProgress(name, phase, "accuracy gate", detail, min(1.0, samples / limit), False)
    latency = status.latency
    started = _parse_time(latency.started_at) if latency else None
    if phase == LATENCY_PHASE and latency is not None and started is not None:
        bake = policy.spec.rollout.bake_seconds
        elapsed = max(0.0, (now - started).total_seconds())
        fraction = 1.0 if bake == 0 else min(1.0, elapsed / bake)
        last = f", last check {latency.last.verdict}" if latency.last else ""
        detail = f"latency analysis: {latency.passes} passing of {latency.checks} checks{last}"
        return PolicyProgress(name, phase, "latency analysis", detail, fraction, False)
    message = status.message or ""
    return PolicyProgress(name, phase, "", message, None, False)


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    clamped = max(0.0, min(1.0, fraction))
    filled = round(clamped * width)
    return "[" + "#" * filled + "." * (width - filled) + f"] {clamped:4.0%}"


def render_line(progress: PolicyProgress, name_width: int, phase_width: int, *, live: bool) -> str:
    """One policy's line; `live` adds the bar and the counts that change between redraws."""
    head = f"{progress.name.ljust(name_width)}  {progress.phase.ljust(phase_width)}"
    if not live:
        return f"{head}  {progress.detail if progress.done else progress.step}".rstrip()
    gauge = f"{bar(progress.fraction)}  " if progress.fraction is not None else ""
    return f"{head}  {gauge}{progress.detail}".rstrip()


def progress_of(
    objects: Sequence[Mapping[str, Any]], now: datetime, gate_prompts: Mapping[str, int] | None = None
) -> list[PolicyProgress]:
    prompts = gate_prompts or {}
    return [policy_progress(KVPolicy.model_validate(obj), now, prompts.get(obj["metadata"]["name"])) for obj in objects]


class ProgressDisplay:
    """Writes progress to a stream: redrawn in place on a terminal, a line per milestone elsewhere."""

    def __init__(self, stream: TextIO, *, live: bool, width: int = 160, stamp: Callable[[], str] = str) -> None:
        self._stream = stream
        self._stamp = stamp
        self._live = live
        self._width = width
        self._drawn_lines = 0
        self._milestones: dict[str, tuple[str, str, bool]] = {}

    def update(self, progress: Sequence[PolicyProgress]) -> None:
        if not progress:
            return
        name_width = max(len(p.name) for p in progress)
        phase_width = max(PHASE_WIDTH, *(len(p.phase) for p in progress))
        if self._live:
            lines = [render_line(p, name_width, phase_width, live=True)[: self._width] for p in progress]
            # Cursor to the start of our block, then rewrite each line and clear what the old one left behind.
            redraw = f"\x1b[{self._drawn_lines}F" if self._drawn_lines else ""
            self._stream.write(redraw + "".join(f"\x1b[2K{line}\n" for line in lines))
            self._drawn_lines = len(lines)
        else:
            for p in progress:
                if self._milestones.get(p.name) != p.milestone:
                    self._milestones[p.name] = p.milestone
                    line = render_line(p, name_width, phase_width, live=False)
                    self._stream.write(f"{self._stamp()}{line}\n")
        self._stream.flush()

    def note(self, text: str) -> None:
        """A line above the live block (setup steps); the block is drawn again on the next update."""
        self._stream.write(text + "\n")
        self._stream.flush()
        self._drawn_lines = 0
