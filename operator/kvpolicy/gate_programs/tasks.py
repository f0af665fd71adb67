"""The accuracy gate's tasks, by the name a KVPolicy gives (`spec.gates.accuracy.task`, api.v1alpha1.AccuracyTask).

A task is pure: the text before the haystack, the haystack's units (tokenized once per gate run), a seeded sample per
index (needles, their depths, the questions and the answers each expects) and string_match_all's per-answer score.
The gate (accuracy.py) sizes every prompt in token space and does the I/O; the simulator answers any task of the
niah family from its numerics (niah.parse_prompt).

Adding a task touches three files: its value in api/v1alpha1.py's AccuracyTask (the CRD's enum; then `make
generate`), its module here in gate_programs/ (prompt building and scoring), and its line in TASKS below. A test of
its templates and scoring goes beside the others (tests/gates/test_gate_tasks.py). The simulator answers any prompt of
the niah family (niah.parse_prompt) and MRCR's asks; a task asking something of a new shape also needs its answer in
dev/kvpolicy_dev/sim/accuracy.py, or the simulator cannot play it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpolicy.api.v1alpha1 import AccuracyTask
from kvpolicy.gate_programs import mrcr, niah, ruler

Chat = Callable[[int, niah.TaskSample, niah.Question, int], list[niah.Message]]


@dataclass(frozen=True)
class Task:
    """A task. `chat(seed, sample, question, words)` is the question's chat with `words` words of haystack (chat
    prompts are sized by words, completions in token space from `header` and `units`)."""

    name: AccuracyTask
    header: str
    units: Callable[[int], tuple[str, ...]]  # seed -> the haystack's units, repeated to fill it
    draw: Callable[[int, int], niah.TaskSample]  # (seed, index) -> sample
    chat: Chat
    score: Callable[[str, tuple[str, ...]], tuple[bool, ...]] = niah.matches_per_needle
    answer_tokens: int = 64
    chat_only: bool = False


def _niah_chat(header: str, units: Callable[[int], tuple[str, ...]]) -> Chat:
    def chat(seed: int, sample: niah.TaskSample, question: niah.Question, words: int) -> list[niah.Message]:
        order = sample.unit_order
        haystack = units(seed) if order is None else tuple(units(seed)[i] for i in order)
        return [{"role": "user", "content": niah.chat_text(header, haystack, sample, question, words)}]

    return chat


def _mix(name: AccuracyTask, one_question: bool) -> Callable[[int, int], Task]:
    def build(needles: int, asked: int) -> Task:
        return Task(
            name=name,
            header=niah.HEADER,
            units=lambda seed: niah.filler_sentences(),
            draw=lambda seed, index: niah.mix_sample(seed, index, needles, asked, one_question),
            chat=_niah_chat(niah.HEADER, lambda seed: niah.filler_sentences()),
        )

    return build


def _ruler(name: AccuracyTask, config: ruler.RulerNiah) -> Callable[[int, int], Task]:
    def build(needles: int, asked: int) -> Task:
        return Task(
            name=name,
            header=config.header(),
            units=lambda seed: ruler.units(config, seed),
            draw=lambda seed, index: ruler.draw(config, seed, index),
            chat=_niah_chat(config.header(), lambda seed: ruler.units(config, seed)),
        )

    return build


def _conversation(seed: int, sample: niah.TaskSample, question: niah.Question, words: int) -> list[niah.Message]:
    if sample.conversation is None:
        raise ValueError("an mrcr sample carries its conversation")
    return sample.conversation(words)


def _mrcr(needles: int, asked: int) -> Task:
    """MRCR with `needles` identical asks (the mix's `asked` does not apply)."""
    return Task(
        name=AccuracyTask.MRCR,
        header="",
        units=lambda seed: (),
        draw=lambda seed, index: mrcr.task_sample(mrcr.draw(needles, seed, index)),
        chat=_conversation,
        score=mrcr.score,
        answer_tokens=mrcr.ANSWER_TOKENS,
        chat_only=True,
    )


# Each task from the mix's needles and asked counts (RULER's tasks fix their own).
TASKS: dict[AccuracyTask, Callable[[int, int], Task]] = {
    AccuracyTask.MULTIKEY: _mix(AccuracyTask.MULTIKEY, one_question=False),
    AccuracyTask.MULTIQUERY: _mix(AccuracyTask.MULTIQUERY, one_question=True),
    AccuracyTask.NIAH_SINGLE_1: _ruler(AccuracyTask.NIAH_SINGLE_1, ruler.NIAH_SINGLE_1),
    AccuracyTask.NIAH_MULTIKEY_2: _ruler(AccuracyTask.NIAH_MULTIKEY_2, ruler.NIAH_MULTIKEY_2),
    AccuracyTask.NIAH_MULTIKEY_3: _ruler(AccuracyTask.NIAH_MULTIKEY_3, ruler.NIAH_MULTIKEY_3),
    AccuracyTask.NIAH_MULTIVALUE: _ruler(AccuracyTask.NIAH_MULTIVALUE, ruler.NIAH_MULTIVALUE),
    AccuracyTask.NIAH_MULTIQUERY: _ruler(AccuracyTask.NIAH_MULTIQUERY, ruler.NIAH_MULTIQUERY),
    AccuracyTask.MRCR: _mrcr,
}


def task(name: AccuracyTask, needles: int = 8, asked: int = 8) -> Task:
    """The task called `name`; `needles` and `asked` shape the mix (multikey, multiquery), `needles` mrcr's
    identical asks."""
    return TASKS[name](needles, asked)
