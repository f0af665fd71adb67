"""RULER-style needle-in-a-haystack prompts: construction (gate side), parsing (simulator side) and scoring, and the
types every task's samples share (`TaskSample`, `Question`; the tasks: tasks.py, RULER's own: ruler.py).

The mix (tasks `multikey`, `multiquery`): the haystack is RULER's "noise" filler; needles follow RULER's niah
template ("One of the special magic numbers for KEY is: VALUE."). Several distinct keys are hidden in one haystack
(niah_multikey: the others are distractors), and the task says how the asked ones are asked:
- `multikey` (the default): each asked needle in a request of its own with RULER's single-key question, all of them
  over the same haystack, so the server's prefix cache prefills the haystack once and every further question costs a
  few tokens. One long prefill scores several needles, and a small model answers one key at a time far more often
  than several at once (BENCHMARKS.md, "Real model").
- `multiquery`: all asked needles in one question (RULER's niah_multiquery wording), one request.
Scoring is RULER's string_match_all, needle by needle.

The gate builds prompts in token space (`PromptPieces`, `assemble`): each piece is tokenized once by the server, the
haystack is made of whole filler sentences and cut to fit, and the token ids are sent as the prompt. Every prompt's
length is exact by construction, for any tokenizer, and no needle is ever cut. `render` gives one prompt as text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import numpy as np
import numpy.typing as npt

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "\nWhat are all the special magic numbers for {keys} mentioned in the provided text? "
    "The special magic numbers for {keys} mentioned in the provided text are"
)
# RULER's question when one key is asked.
SINGLE_QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
# Decoded token ids may differ from the text in case and in spaces around punctuation (WordPiece gives "rustic -
# glacier is : 42"): the patterns allow both. Keys are word pairs or UUIDs, values numbers or UUIDs (RULER's types).
_UUID = r"[0-9a-f]{8}(?:\s*-\s*[0-9a-f]{4}){3}\s*-\s*[0-9a-f]{12}"
NEEDLE_PATTERN = re.compile(
    rf"one of the special magic (?:numbers|uuids) for ([a-z]+\s*-\s*[a-z]+|{_UUID})\s+is\s*:\s*({_UUID}|\d+)", re.I
)
QUESTION_PATTERN = re.compile(
    r"what (?:are all the special magic (?:numbers|uuids)|is the special magic (?:number|uuid)) for (.+?) mentioned "
    r"in the provided text\s*\?",
    re.I | re.S,
)

T = TypeVar("T")


_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "nimble", "olive", "proud", "quiet", "rustic", "silent", "tidy", "upbeat", "vivid", "witty", "young",
    "zesty", "bold", "crisp", "deep", "early", "fancy"
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island", "jaguar", "kettle",
    "lantern", "meadow", "nectar", "orchard", "pepper", "quarry", "river", "saddle", "thistle", "umbrella",
    "violin", "walnut", "yonder", "zephyr", "beacon", "cobalt", "dune"
)  # fmt: skip


@lru_cache(maxsize=1)
def key_words() -> tuple[str, ...]:
    """Every word-pair key (RULER's `words` keys are adjective-noun pairs too)."""
    return tuple(f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS)


@dataclass(frozen=True)
class Needle:
    key: str
    value: str


@dataclass(frozen=True)
class NiahSample:
    """One prompt's needles (in haystack order), the keys asked for, and where the needles sit (0..1 depth)."""

    needles: tuple[Needle, ...]
    asked: tuple[Needle, ...]
    depths: tuple[float, ...]

    @property
    def expected(self) -> tuple[str, ...]:
        return tuple(needle.value for needle in self.asked)


def draw_sample(seed: int, index: int, num_needles: int = 8, num_asked: int = 8) -> NiahSample:
    """The `index`-th sample of a seeded sequence: distinct word-pair keys, 7-digit values, spread depths."""
    if not 1 <= num_asked <= num_needles:
        raise ValueError(f"num_asked must be between 1 and num_needles ({num_needles}), got {num_asked}")
    rng = random.Random(f"{seed}:{index}")
    keys = rng.sample(list(key_words()), num_needles)
    needles = tuple(Needle(key, str(rng.randrange(1_000_000, 10_000_000))) for key in keys)
    # Stratified depths: one needle per equal slice of the haystack, jittered inside its slice.
    depths = tuple((i + rng.random()) / num_needles for i in range(num_needles))
    asked = tuple(rng.sample(needles, num_asked))
    return NiahSample(needles=needles, asked=asked, depths=depths)


@lru_cache(maxsize=1)
def _filler_pieces() -> tuple[str, ...]:
    """The filler as words with their leading space and full stops: one token each for common tokenizers."""
    return tuple(re.findall(r" ?[^\s.]+|\.", " " + FILLER))


def _haystack(filler_pieces: int) -> list[str]:
    """The first `filler_pieces` pieces of the repeated filler."""
    unit = _filler_pieces()
    repeats, rest = divmod(filler_pieces, len(unit))
    return list(unit * repeats + unit[:rest])


def _sentence_ends(filler_pieces: int) -> npt.NDArray[np.int64]:
    """Piece offsets just after each full stop in the first `filler_pieces` pieces of haystack."""
    unit = _filler_pieces()
    in_unit = np.array([i + 1 for i, piece in enumerate(unit) if piece == "."])
    repeats = filler_pieces // len(unit) + 1
    ends: npt.NDArray[np.int64] = (np.arange(repeats)[:, None] * len(unit) + in_unit).ravel()
    return ends[ends <= filler_pieces]


def _insert_nearest(haystack: Sequence[T], ends: Sequence[int], items: Iterable[tuple[float, Sequence[T]]]) -> list[T]:
    """`haystack` with each item inserted whole at the offset in `ends` nearest its target (the earlier one on a
    tie); items at one offset keep their order."""
    offsets = np.asarray(ends)
    inserts: dict[int, list[T]] = {}
    for target, item in items:
        nearest = int(offsets[np.argmin(np.abs(offsets - target))])
        inserts.setdefault(nearest, []).extend(item)
    joined: list[T] = []
    previous = 0
    for offset in sorted(inserts):
        joined += haystack[previous:offset]
        joined += inserts[offset]
        previous = offset
    joined += haystack[previous:]
    return joined


def render(sample: NiahSample, filler_pieces: int, asked: Sequence[Needle] | None = None) -> str:
    """The prompt text with `filler_pieces` pieces of haystack, the needles inserted at their depths, and a question
    for `asked` (default: all the sample's asked needles in one question).

    Needles go in at the sentence end nearest their depth, so the filler stays grammatical around them.
    """
    ends: list[int] = _sentence_ends(filler_pieces).tolist() or [filler_pieces]
    needles = [
        (depth * filler_pieces, [needle_text(needle)])
        for needle, depth in zip(sample.needles, sample.depths, strict=True)
    ]
    question = question_text(sample.asked if asked is None else asked)
    return "".join([HEADER, *_insert_nearest(_haystack(filler_pieces), ends, needles), question])


def string_match_all(output: str, expected: tuple[str, ...]) -> float:
    """RULER's metric: the fraction of expected strings that occur in the output, case-insensitively."""
    if not expected:
        raise ValueError("string_match_all needs at least one expected string")
    lowered = output.lower()
    return sum(value.lower() in lowered for value in expected) / len(expected)


def matches_per_needle(output: str, expected: tuple[str, ...]) -> tuple[bool, ...]:
    lowered = output.lower()
    return tuple(value.lower() in lowered for value in expected)


def _normal(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


def parse_prompt(prompt: str) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """Needles present in a prompt (key -> its values, in prompt order) and the keys its question asks for (empty if
    it asks none). Any task of this module's family: the mix's prompts and RULER's."""
    needles: dict[str, tuple[str, ...]] = {}
    for key, value in NEEDLE_PATTERN.findall(prompt):
        values = needles.get(_normal(key), ())
        if _normal(value) not in values:
            needles[_normal(key)] = (*values, _normal(value))
    question = QUESTION_PATTERN.search(prompt)
    keys = re.split(r",\s*(?:and\s+)?|\s+and\s+", question.group(1)) if question else []
    asked = tuple(_normal(key) for key in keys if key.strip())
    return needles, asked


def needle_text(needle: Needle) -> str:
    """A needle as it stands in the haystack: after a sentence, with its leading space."""
    return " " + NEEDLE.format(key=needle.key, value=needle.value)


def question_text(asked: Sequence[Needle]) -> str:
    """RULER's question for these needles: the single-key wording for one, the multiquery wording for several."""
    if not asked:
        raise ValueError("a question asks for at least one needle")
    if len(asked) == 1:
        return SINGLE_QUESTION.format(key=asked[0].key)
    return QUESTION.format(keys=", ".join(needle.key for needle in asked))


@dataclass(frozen=True)
class Question:
    """One request's question (with its answer prefix), as it follows the haystack, and the answers it expects:
    string_match_all scores each of them found or not."""

    text: str
    expected: tuple[str, ...]


Message = dict[str, str]
THINKING = re.compile(r"^\s*(?:<think>)?.*?</think>", re.S)


def strip_thinking(response: str) -> str:
    """A chat answer without a leading reasoning block ending in </think> (with or without its <think>)."""
    return THINKING.sub("", response, count=1).lstrip() if "</think>" in response else response


def chat_question(question: Question) -> str:
    """A question as a chat asks it: through its question mark, without the answer prefix a completion ends with
    (the chat template starts the assistant's turn instead)."""
    text = question.text
    return text[: text.rindex("?") + 1] if "?" in text else text


def chat_text(header: str, units: Sequence[str], sample: TaskSample, question: Question, words: int) -> str:
    """One chat message's text: the header, `words` words of the haystack (its units repeated in order, the last one
    cut at a word) with each needle whole at the unit end nearest its depth, and the question."""
    pieces = [re.findall(r"\s*\S+", unit) for unit in units]
    if not all(pieces):
        raise ValueError("every haystack unit needs a word")
    haystack: list[str] = []
    ends = [0]
    index = 0
    while len(haystack) < words:
        unit = pieces[index % len(pieces)]
        haystack += unit[: words - len(haystack)]
        ends.append(len(haystack))
        index += 1
    needles = [(depth * words, [needle]) for needle, depth in zip(sample.needles, sample.depths, strict=True)]
    return header + "".join(_insert_nearest(haystack, ends, needles)) + chat_question(question)


@dataclass(frozen=True)
class TaskSample:
    """One sample of any task: its needles' texts as they stand in the haystack (with their separator), their depths
    (0..1), the questions asked over the same haystack (one request each), and the order in which the task's
    haystack units fill it (None: in order)."""

    needles: tuple[str, ...]
    depths: tuple[float, ...]
    questions: tuple[Question, ...]
    unit_order: tuple[int, ...] | None = None
    # A task that is a conversation (mrcr): its chat with this many words of haystack.
    conversation: Callable[[int], list[Message]] | None = None

    def __post_init__(self) -> None:
        if len(self.needles) != len(self.depths):
            raise ValueError(f"{len(self.depths)} depths for {len(self.needles)} needles")
        if not self.questions:
            raise ValueError("a sample asks at least one question")


def mix_sample(seed: int, index: int, num_needles: int, num_asked: int, one_question: bool) -> TaskSample:
    """The mix's sample (`draw_sample`): each asked needle in a request of its own (multikey), or all in one."""
    sample = draw_sample(seed, index, num_needles, num_asked)
    asked = ((needle,) for needle in sample.asked) if not one_question else (sample.asked,)
    return TaskSample(
        needles=tuple(needle_text(needle) for needle in sample.needles),
        depths=sample.depths,
        questions=tuple(Question(question_text(group), tuple(n.value for n in group)) for group in asked),
    )


def filler_sentences() -> tuple[str, ...]:
    """The filler's sentences, each with its leading space (the haystack repeats them in order)."""
    return tuple(re.findall(r" [^.]+\.", " " + FILLER))


TokenIds = tuple[int, ...]


@dataclass(frozen=True)
class PromptPieces:
    """The token ids of one sample's prompt pieces, each tokenized on its own by the server's tokenizer.

    `prefix` and `suffix` are the special tokens the server puts around a text prompt (a BOS; BERT's [CLS] and [SEP];
    T5's </s>), so a prompt sent as ids reads as the same prompt sent as text would. `questions` holds one question
    per request made over the haystack.
    """

    prefix: TokenIds
    suffix: TokenIds
    header: TokenIds
    sentences: tuple[TokenIds, ...]
    needles: tuple[TokenIds, ...]
    questions: tuple[TokenIds, ...]

    def __post_init__(self) -> None:
        if not self.sentences or not all(self.sentences):
            raise ValueError("every filler sentence must tokenize to at least one token")
        if not all(self.needles):
            raise ValueError("every needle must tokenize to at least one token")
        if not self.questions:
            raise ValueError("prompt pieces need at least one question")

    @property
    def fixed_tokens(self) -> int:
        """Tokens of everything but the haystack, with the longest question: the shortest prompt these pieces can
        make."""
        pieces = (self.prefix, self.suffix, self.header, *self.needles)
        return sum(len(piece) for piece in pieces) + max(len(question) for question in self.questions)


def _token_haystack(sentences: tuple[TokenIds, ...], budget: int) -> tuple[list[int], list[int]]:
    """`budget` tokens of the repeated sentences (the last one cut to fit), and the offsets after each whole one.

    Every pass of the loop adds a whole non-empty sentence or ends it, so it runs at most `budget` times."""
    haystack: list[int] = []
    ends = [0]
    index = 0
    while len(haystack) < budget:
        sentence = sentences[index % len(sentences)]
        room = budget - len(haystack)
        haystack += sentence[:room]
        if len(sentence) <= room:
            ends.append(len(haystack))
        index += 1
    if ends[-1] != budget:
        ends.append(budget)
    return haystack, ends


def assemble(pieces: PromptPieces, depths: tuple[float, ...], length: int) -> list[list[int]]:
    """One prompt of exactly `length` tokens per question: prefix, header, haystack with each needle whole at the
    sentence end nearest its depth, the question, suffix. The prompts differ only after the needles: a shorter
    question gets that much more filler before it, so they share the haystack and the server prefills it once.
    ValueError when the fixed pieces alone take `length` tokens or more."""
    if len(depths) != len(pieces.needles):
        raise ValueError(f"{len(depths)} depths for {len(pieces.needles)} needles")
    budget = length - pieces.fixed_tokens
    if budget < 0:
        raise ValueError(f"the prompt's header, needles and question alone take {pieces.fixed_tokens} tokens")
    longest = max(len(question) for question in pieces.questions)
    shortest = min(len(question) for question in pieces.questions)
    haystack, ends = _token_haystack(pieces.sentences, budget + longest - shortest)
    # Needles sit in the first `budget` tokens, which every prompt has: the rest is the shorter questions' filler.
    needle_ends = [end for end in ends if end < budget] + [budget]
    needles = [(depth * budget, needle) for needle, depth in zip(pieces.needles, depths, strict=True)]
    shared = [*pieces.prefix, *pieces.header, *_insert_nearest(haystack, needle_ends, needles)]
    head = length - longest - len(pieces.suffix)
    return [[*shared[: head + longest - len(question)], *question, *pieces.suffix] for question in pieces.questions]
