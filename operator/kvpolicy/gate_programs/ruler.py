"""RULER's needle-in-a-haystack tasks (NVIDIA/RULER scripts/synthetic.yaml, scripts/data/synthetic/niah.py), with its
template, answer prefix and string_match_all scoring: niah_single_1, niah_multikey_2, niah_multikey_3,
niah_multivalue and niah_multiquery. Pure: text and seeded draws only (the gate sizes the prompts in token space).

RULER's prompt for a base model is its template followed by its answer prefix (`model_template_type: base`):

    Some special magic {type} are hidden within the following text. Make sure to memorize it. I will quiz you about
    the {type} afterwards.\\n{context}\\nWhat are all the special magic {type} for {query} mentioned in the provided
    text? The special magic {type} for {query} mentioned in the provided text are

and when one value is asked (num_needle_q * num_needle_v == 1) RULER rewrites it to the singular: "Some" -> "A",
"are all" -> "is", "are" -> "is", and the type loses its "s". The context is lines joined by newlines: the filler line
repeated (`noise`) or distractor needles (`needle`), with the needles inserted as lines of their own at random places;
several queried keys are joined "a, b, and c". Needles: "One of the special magic {type} for {key} is: {value}.";
word keys are adjective-noun pairs, numbers 7 digits, UUIDs version 4.

Where this differs from RULER, and why:
- niah_multivalue and niah_multiquery draw their haystack from Paul Graham's essays in RULER (`essay`); no dataset
  ships here, so they use the repeated filler line, as niah_single_1 does.
- RULER's distractors are all distinct; here each gate run draws a pool of DISTRACTOR_POOL distinct distractor lines,
  tokenized once, and each sample fills its haystack from the pool in its own seeded order, repeating the pool when
  the prompt needs more lines (at 128k tokens each distractor appears a few tens of times). The needle's key is never
  a distractor's.
- RULER finds a prompt's length by a search over the number of haystack lines; the gate builds it in token space to
  the exact length, so the last filler line before the question may be cut.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from enum import StrEnum

from kvpolicy.gate_programs.niah import FILLER, Question, TaskSample, key_words

TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for "
    "{query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
CONTEXT = "{context}"
DISTRACTOR_POOL = 128


class Haystack(StrEnum):
    NOISE = "noise"  # the filler line repeated
    NEEDLE = "needle"  # distractor needles


class Kind(StrEnum):
    WORDS = "words"
    NUMBERS = "numbers"
    UUIDS = "uuids"


@dataclass(frozen=True)
class RulerNiah:
    """One of synthetic.yaml's niah configurations."""

    haystack: Haystack
    key: Kind
    value: Kind
    num_needle_k: int
    num_needle_v: int
    num_needle_q: int

    @property
    def singular(self) -> bool:
        return self.num_needle_q * self.num_needle_v == 1

    @property
    def type_needle_v(self) -> str:
        return self.value.value[:-1] if self.singular else self.value.value

    def template(self) -> str:
        """RULER's template and answer prefix, singular when one value is asked (its own string replacements)."""
        template = TEMPLATE + ANSWER_PREFIX
        if self.singular:
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
        return template

    def header(self) -> str:
        """What comes before the context (RULER's newline after it is each haystack line's own)."""
        before, _ = self.template().split("\n" + CONTEXT)
        return before.format(type_needle_v=self.type_needle_v)

    def question(self, queries: list[str]) -> str:
        """The text after the context, from RULER's newline on: the question and the answer prefix."""
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        _, after = self.template().split(CONTEXT)
        return after.format(type_needle_v=self.type_needle_v, query=query)

    def needle(self, key: str, value: str) -> str:
        """A needle line, as it stands in the context (after a newline)."""
        return "\n" + NEEDLE.format(type_needle_v=self.value.value, key=key, value=value)


NIAH_SINGLE_1 = RulerNiah(Haystack.NOISE, Kind.WORDS, Kind.NUMBERS, 1, 1, 1)
NIAH_MULTIKEY_2 = RulerNiah(Haystack.NEEDLE, Kind.WORDS, Kind.NUMBERS, 1, 1, 1)
NIAH_MULTIKEY_3 = RulerNiah(Haystack.NEEDLE, Kind.UUIDS, Kind.UUIDS, 1, 1, 1)
NIAH_MULTIVALUE = RulerNiah(Haystack.NOISE, Kind.WORDS, Kind.NUMBERS, 1, 4, 1)
NIAH_MULTIQUERY = RulerNiah(Haystack.NOISE, Kind.WORDS, Kind.NUMBERS, 4, 1, 4)


def _random(kind: Kind, rng: random.Random) -> str:
    """RULER's generate_random: an adjective-noun pair, a 7-digit number, or a version-4 UUID."""
    if kind == Kind.WORDS:
        return rng.choice(key_words())
    if kind == Kind.NUMBERS:
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _pool(config: RulerNiah, seed: int) -> tuple[list[str], list[str]]:
    """The run's distractors (key, value), distinct keys."""
    rng = random.Random(f"ruler-distractors:{seed}")
    keys: list[str] = []
    values: list[str] = []
    while len(keys) < DISTRACTOR_POOL:
        key = _random(config.key, rng)
        if key not in keys:
            keys.append(key)
            values.append(_random(config.value, rng))
    return keys, values


def units(config: RulerNiah, seed: int) -> tuple[str, ...]:
    """The haystack's lines, each with the newline before it: the filler line, or the run's distractor pool."""
    if config.haystack == Haystack.NOISE:
        return ("\n" + FILLER,)
    keys, values = _pool(config, seed)
    return tuple(config.needle(key, value) for key, value in zip(keys, values, strict=True))


def draw(config: RulerNiah, seed: int, index: int) -> TaskSample:
    """The `index`-th sample of a seeded sequence, as RULER's generate_input_output draws it: keys and values, the
    needles shuffled, at random places (depths), num_needle_q keys asked in one question."""
    rng = random.Random(f"ruler:{seed}:{index}")
    taken = set(_pool(config, seed)[0]) if config.haystack == Haystack.NEEDLE else set()
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    while len(keys) < config.num_needle_k:
        key = _random(config.key, rng)
        if key in taken or key in keys:
            continue
        keys.append(key)
        values.append([_random(config.value, rng) for _ in range(config.num_needle_v)])
        needles += [config.needle(key, value) for value in values[-1]]
    rng.shuffle(needles)
    depths = tuple(sorted(rng.random() for _ in needles))
    asked = rng.sample(range(config.num_needle_k), config.num_needle_q)
    question = Question(config.question([keys[i] for i in asked]), tuple(v for i in asked for v in values[i]))
    order = None
    if config.haystack == Haystack.NEEDLE:
        order = tuple(rng.sample(range(DISTRACTOR_POOL), DISTRACTOR_POOL))
    return TaskSample(needles=tuple(needles), depths=depths, questions=(question,), unit_order=order)
