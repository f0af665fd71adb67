"""MRCR's format and scoring (openai/mrcr, the long-context benchmark of vLLM's FP8 KV blog), with conversations
generated here deterministically by seed: MRCR's dataset is in no package and cannot be downloaded, so this is its
format and its official score, not its data.

A sample is a long multi-turn chat: distractor asks ("write a riddle about lanterns", each answered by the assistant)
with NEEDLES identical asks ("write a poem about tapirs") among them, each answered differently; the last user turn
asks "Prepend {prefix} to the {i}th (1 indexed) poem about tapirs. Do not include any other text in your response."
The expected answer is the prefix followed by the i-th of those answers. Score (MRCR's grade): 0 unless the response
starts with the prefix, else `difflib.SequenceMatcher(None, response_without_prefix, answer_without_prefix).ratio()`.
The gate strips a reasoning model's leading `<think>...</think>` block first (niah.strip_thinking).

The gate's tests count right and wrong needles; a score s in [0, 1] counts as right with probability s, by a uniform
draw seeded by the expected answer, the same for canary and baseline (`right`): equal scores count alike, and the
expected count of right answers is the sum of the scores, so recovery stays the ratio of mean scores.

The assistant's answers are made of this module's word lists (a few short lines each): what the model must do is find
the i-th of the identical asks and copy its answer, as in MRCR. The chat is sized by words of distractor turns
(`messages(words)`): the gate finds the largest count whose templated length fits (accuracy.py).
"""

from __future__ import annotations

import difflib
import hashlib
import random
import re
import string
from dataclasses import dataclass
from typing import NamedTuple

from kvpolicy.gate_programs.niah import Question, TaskSample, key_words

NEEDLE_COUNTS = (2, 4, 8)
PREFIX_LENGTH = 10
# The asked answer is 4-6 lines of about 12 words, after the prefix.
ANSWER_TOKENS = 256
FORMATS = ("poem", "short story", "riddle", "haiku", "limerick", "short essay", "song", "speech")
ASK = "Write a {form} about {topic}."
FINAL = (
    "Prepend {prefix} to the {ordinal} (1 indexed) {form} about {topic}. Do not include any other text in your "
    "response."
)
_VERBS = ("wanders", "glows", "sings", "waits", "drifts", "listens", "rests", "turns", "shines", "hides")
_PLACES = ("by the river", "under the hill", "in the quiet dark", "across the field", "beside the sea",
           "through the morning", "at the edge of town", "among the trees")  # fmt: skip

Message = dict[str, str]


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _words() -> tuple[str, ...]:
    return key_words()


def response_text(rng: random.Random, topic: str) -> str:
    """An assistant's answer: four to six short lines about `topic`."""
    lines = []
    for _ in range(rng.randint(4, 6)):
        first, second = rng.choice(_words()).split("-")
        lines.append(f"The {first} {topic} {rng.choice(_VERBS)} {rng.choice(_PLACES)}, {second} and {first}.")
    return "\n".join(lines)


class Turn(NamedTuple):
    """A user's ask and the assistant's answer to it."""

    ask: str
    answer: str


@dataclass(frozen=True)
class MrcrSample:
    """One conversation: the needle turns (in order), their depths among the distractors, the final ask, and the
    expected answer (prefix + the asked needle's answer). `distractor(j)` is the j-th distractor turn."""

    seed: str
    needles: tuple[Turn, ...]
    depths: tuple[float, ...]
    prefix: str
    asked: int  # 0-based index of the needle asked for
    final: str

    @property
    def expected(self) -> str:
        return self.prefix + self.needles[self.asked].answer

    def distractor(self, index: int) -> Turn:
        rng = random.Random(f"{self.seed}:distractor:{index}")
        needle_form, needle_topic = _needle_ask(self.needles[0].ask)
        while True:
            form, topic = rng.choice(FORMATS), rng.choice(_words()).split("-")[1]
            if (form, topic) != (needle_form, needle_topic):
                return Turn(ASK.format(form=form, topic=topic), response_text(rng, topic))

    def messages(self, words: int) -> list[Message]:
        """The chat with `words` words of distractor answers (the last distractor's answer cut to fit), the needle
        turns at their depths, and the final ask."""
        turns: list[Turn] = []
        used = 0
        index = 0
        while used < words:
            turn = self.distractor(index)
            answer_words = turn.answer.split(" ")
            room = words - used
            answer = turn.answer if len(answer_words) <= room else " ".join(answer_words[:room])
            turns.append(Turn(turn.ask, answer))
            used += min(len(answer_words), room)
            index += 1
        places = [round(depth * len(turns)) for depth in self.depths]
        for offset, (place, needle) in enumerate(zip(places, self.needles, strict=True)):
            turns.insert(place + offset, needle)
        messages: list[Message] = []
        for turn in turns:
            messages += [{"role": "user", "content": turn.ask}, {"role": "assistant", "content": turn.answer}]
        return [*messages, {"role": "user", "content": self.final}]


def _needle_ask(ask: str) -> tuple[str, str]:
    match = re.fullmatch(r"Write an? (.+) about (\w+)\.", ask)
    if match is None:
        raise ValueError(f"not an ask: {ask!r}")
    return match.group(1), match.group(2)


def draw(needles: int, seed: int, index: int) -> MrcrSample:
    """The `index`-th conversation of a seeded sequence with `needles` identical asks (2, 4 or 8)."""
    if needles not in NEEDLE_COUNTS:
        raise ValueError(f"MRCR hides 2, 4 or 8 identical asks, not {needles}")
    key = f"mrcr:{needles}:{seed}:{index}"
    rng = random.Random(key)
    form, topic = rng.choice(FORMATS), rng.choice(_words()).split("-")[1]
    turns = tuple(Turn(ASK.format(form=form, topic=topic), response_text(rng, topic)) for _ in range(needles))
    depths = tuple(sorted(rng.random() for _ in range(needles)))
    prefix = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(PREFIX_LENGTH))
    asked = rng.randrange(needles)
    final = FINAL.format(prefix=prefix, ordinal=ordinal(asked + 1), form=form, topic=topic)
    return MrcrSample(key, turns, depths, prefix, asked, final)


def grade(response: str, answer: str, prefix: str) -> float:
    """MRCR's official score: 0 unless the response starts with the prefix, else the SequenceMatcher ratio of the
    rest against the answer's rest."""
    if not response.startswith(prefix):
        return 0.0
    return difflib.SequenceMatcher(None, response.removeprefix(prefix), answer.removeprefix(prefix)).ratio()


def right(score: float, answer: str) -> bool:
    """A score counted as a right needle with probability `score`, by a draw seeded by the answer (both sides
    alike)."""
    digest = hashlib.blake2b(answer.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < score


def score(response: str, expected: tuple[str, ...]) -> tuple[bool, ...]:
    """The gate's needles for one response: each expected answer (prefix + text) graded and counted (`right`)."""
    return tuple(right(grade(response, answer, answer[:PREFIX_LENGTH]), answer) for answer in expected)


def task_sample(sample: MrcrSample) -> TaskSample:
    """The conversation as the gate's sample: one question (the final ask), expecting prefix + the asked answer."""
    return TaskSample(
        needles=(), depths=(), questions=(Question(sample.final, (sample.expected,)),), conversation=sample.messages
    )
