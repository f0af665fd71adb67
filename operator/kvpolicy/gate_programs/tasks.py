"""The accuracy gate's tasks, by the name a KVPolicy gives (`spec.gates.accuracy.task`, api.v1alpha1.AccuracyTask).

A task is pure: the text before the haystack, the haystack's units (tokenized once per gate run), a seeded sample per
index (needles, their depths, the questions and the answers each expects) and string_match_all's per-answer score.
The gate (accuracy.py) sizes every prompt in token space and does the I/O; the simulator answers any task of the
niah family from its numerics (niah.parse_prompt).

Adding a task touches three files: its value in api/v1alpha1.py's AccuracyTask (the CRD's enum; then `make
generate`), its module here in gate_programs/ (prompt building and scoring), and its line in TASKS below. A test of
its templates and scoring goes beside the others (tests/gates/test_gate_tasks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpolicy.api.v1alpha1 import AccuracyTask
from kvpolicy.gate_programs import niah, ruler


@dataclass(frozen=True)
class Task:
    name: AccuracyTask
    header: str
    units: Callable[[int], tuple[str, ...]]  # seed -> the haystack's units, repeated to fill it
    draw: Callable[[int, int], niah.TaskSample]  # (seed, index) -> sample
    score: Callable[[str, tuple[str, ...]], tuple[bool, ...]] = niah.matches_per_needle


def _mix(name: AccuracyTask, one_question: bool) -> Callable[[int, int], Task]:
    def build(needles: int, asked: int) -> Task:
        return Task(
            name=name,
            header=niah.HEADER,
            units=lambda seed: niah.filler_sentences(),
            draw=lambda seed, index: niah.mix_sample(seed, index, needles, asked, one_question),
        )

    return build


def _ruler(name: AccuracyTask, config: ruler.RulerNiah) -> Callable[[int, int], Task]:
    def build(needles: int, asked: int) -> Task:
        return Task(
            name=name,
            header=config.header(),
            units=lambda seed: ruler.units(config, seed),
            draw=lambda seed, index: ruler.draw(config, seed, index),
        )

    return build


# Each task from the mix's needles and asked counts (RULER's tasks fix their own).
TASKS: dict[AccuracyTask, Callable[[int, int], Task]] = {
    AccuracyTask.MULTIKEY: _mix(AccuracyTask.MULTIKEY, one_question=False),
    AccuracyTask.MULTIQUERY: _mix(AccuracyTask.MULTIQUERY, one_question=True),
    AccuracyTask.NIAH_SINGLE_1: _ruler(AccuracyTask.NIAH_SINGLE_1, ruler.NIAH_SINGLE_1),
    AccuracyTask.NIAH_MULTIKEY_2: _ruler(AccuracyTask.NIAH_MULTIKEY_2, ruler.NIAH_MULTIKEY_2),
    AccuracyTask.NIAH_MULTIKEY_3: _ruler(AccuracyTask.NIAH_MULTIKEY_3, ruler.NIAH_MULTIKEY_3),
    AccuracyTask.NIAH_MULTIVALUE: _ruler(AccuracyTask.NIAH_MULTIVALUE, ruler.NIAH_MULTIVALUE),
    AccuracyTask.NIAH_MULTIQUERY: _ruler(AccuracyTask.NIAH_MULTIQUERY, ruler.NIAH_MULTIQUERY),
}


def task(name: AccuracyTask, needles: int = 8, asked: int = 8) -> Task:
    """The task called `name`; `needles` and `asked` shape the mix (multikey, multiquery) only."""
    return TASKS[name](needles, asked)
