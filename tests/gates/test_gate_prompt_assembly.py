"""Prompt sizing in token space: exact length for any pieces and any tokenizer, needles whole, always terminating; a
sample's prompts share everything up to the end of its needles."""

from __future__ import annotations

import asyncio

import pytest
from gate_fakes import COMPLETION_TASKS, assert_prompt_asks
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy.api.v1alpha1 import AccuracyTask
from kvpolicy.gate_programs import niah, tasks
from kvpolicy.gate_programs.accuracy import sample_pieces, shared_pieces, sized_prompts, split_special_tokens
from kvpolicy.gate_programs.client import GateError
from kvpolicy_dev.sim.tokenizer_zoo import Family
from tokenizer_families import FAMILIES, LocalTokenizer

token_lists = st.lists(st.integers(0, 50_000), max_size=40)
non_empty = st.lists(st.integers(0, 50_000), min_size=1, max_size=40)
# Needle ids of their own, so a needle cannot be mistaken for haystack when the walk below checks the prompt.
needle_tokens = st.lists(st.integers(100_000, 100_100), min_size=1, max_size=40)


@st.composite
def pieces_and_depths(draw: st.DrawFn) -> tuple[niah.PromptPieces, tuple[float, ...]]:
    needles = draw(st.lists(needle_tokens.map(tuple), min_size=1, max_size=10))
    depths = draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=len(needles), max_size=len(needles)))
    pieces = niah.PromptPieces(
        prefix=tuple(draw(st.lists(st.integers(0, 9), max_size=2))),
        suffix=tuple(draw(st.lists(st.integers(0, 9), max_size=2))),
        header=tuple(draw(token_lists)),
        sentences=tuple(draw(st.lists(non_empty.map(tuple), min_size=1, max_size=6))),
        needles=tuple(needles),
        questions=tuple(draw(st.lists(token_lists.map(tuple), min_size=1, max_size=4))),
    )
    return pieces, tuple(sorted(depths))


def cyclic_filler(sentences: tuple[tuple[int, ...], ...], count: int) -> list[int]:
    stream: list[int] = []
    while len(stream) < count:
        for sentence in sentences:
            stream += sentence
    return stream[:count]


@settings(max_examples=200, deadline=None)
@given(pieces_and_depths(), st.integers(0, 5_000))
def test_assembly_gives_exactly_the_length_with_every_needle_whole_at_a_sentence_end(
    drawn: tuple[niah.PromptPieces, tuple[float, ...]], extra: int
) -> None:
    pieces, depths = drawn
    length = pieces.fixed_tokens + extra
    prompts = niah.assemble(pieces, depths, length)
    assert len(prompts) == len(pieces.questions)
    head = [*pieces.prefix, *pieces.header]
    # Every needle lies in the part all the prompts share: the server prefills it once.
    shared = len(head) + extra + sum(len(needle) for needle in pieces.needles)
    longest = max(len(question) for question in pieces.questions)
    for tokens, question in zip(prompts, pieces.questions, strict=True):
        assert len(tokens) == length
        assert tokens[:shared] == prompts[0][:shared]
        tail = [*question, *pieces.suffix]
        assert tokens[: len(head)] == head
        assert tokens[len(tokens) - len(tail) :] == tail
        # Walk the middle: the haystack is the filler sentences repeated and cut to fit (a shorter question's the
        # longer by the difference), with the needles, in order and whole, at the sentence end nearest their depth
        # within the first `extra` haystack tokens (or at its very end).
        middle = tokens[len(head) : len(tokens) - len(tail)]
        haystack = extra + longest - len(question)
        filler = cyclic_filler(pieces.sentences, haystack)
        boundaries = {0, extra}
        offset = 0
        while offset < extra:
            for sentence in pieces.sentences:
                offset += len(sentence)
                if offset <= extra:
                    boundaries.add(offset)
        position, used = 0, 0
        for needle, depth in zip(pieces.needles, depths, strict=True):
            while middle[position] != needle[0]:
                assert middle[position] == filler[used], "a haystack token out of order, or a needle not found whole"
                position, used = position + 1, used + 1
            assert used in boundaries, "a needle inside a sentence"
            target = depth * extra
            assert abs(used - target) == min(abs(b - target) for b in boundaries), "a needle off its depth"
            assert middle[position : position + len(needle)] == list(needle), "a needle cut"
            position += len(needle)
        assert middle[position:] == filler[used:]


def test_a_length_below_the_fixed_pieces_is_refused() -> None:
    pieces = niah.PromptPieces((1,), (), (2, 3), ((4,),), ((5, 6),), ((7,), (8, 9)))
    assert pieces.fixed_tokens == 7
    assert [len(prompt) for prompt in niah.assemble(pieces, (0.5,), 7)] == [7, 7]
    with pytest.raises(ValueError, match="alone take 7 tokens"):
        niah.assemble(pieces, (0.5,), 6)
    pieces = niah.PromptPieces((1,), (), (2, 3), ((4,),), ((5, 6),), ((7,),))
    assert len(niah.assemble(pieces, (0.5,), pieces.fixed_tokens)[0]) == pieces.fixed_tokens
    with pytest.raises(ValueError, match="alone take 6 tokens"):
        niah.assemble(pieces, (0.5,), 5)
    with pytest.raises(ValueError, match="every filler sentence must tokenize to at least one token"):
        niah.PromptPieces((), (), (), ((),), ((1,),), ((),))
    with pytest.raises(ValueError, match="at least one question"):
        niah.PromptPieces((), (), (), ((1,),), ((1,),), ())


@pytest.mark.parametrize(
    ("with_special", "without", "expected"),
    [([1, 5, 6], [5, 6], ((1,), ())), ([5, 6, 2], [5, 6], ((), (2,))), ([3, 5, 6, 4], [5, 6], ((3,), (4,)))],
)
def test_special_tokens_are_what_the_server_adds_around_the_text(
    with_special: list[int], without: list[int], expected: tuple[tuple[int, ...], tuple[int, ...]]
) -> None:
    assert split_special_tokens(with_special, without) == expected
    with pytest.raises(ValueError, match="do not contain"):
        split_special_tokens([1, 5, 7], [5, 6])


@pytest.mark.parametrize("family", FAMILIES, ids=str)
@pytest.mark.parametrize("name", COMPLETION_TASKS)
@settings(max_examples=15, deadline=None)
@given(index=st.integers(0, 10_000), extra=st.integers(0, 40_000))
def test_every_tokenizer_family_gives_the_exact_length_and_readable_needles(
    family: Family, name: AccuracyTask, index: int, extra: int
) -> None:
    tokenizer = LocalTokenizer(family)
    task = tasks.task(name, needles=6, asked=3)
    sample = task.draw(3, index)

    async def build() -> tuple[int, list[list[int]]]:
        shared = await shared_pieces(tokenizer, task, 3)
        shortest = (await sample_pieces(tokenizer, shared, sample)).fixed_tokens
        return shortest + extra, await sized_prompts(tokenizer, shared, sample, shortest + extra)

    length, prompts = asyncio.run(build())
    assert len(prompts) == len(sample.questions) == (3 if name == AccuracyTask.MULTIKEY else 1)
    for prompt, question in zip(prompts, sample.questions, strict=True):
        assert len(prompt) == length
        assert_prompt_asks(tokenizer.decode(prompt), sample, question)


def test_a_length_too_short_for_the_needles_says_how_many_tokens_they_take() -> None:
    tokenizer = LocalTokenizer(FAMILIES[0])

    async def build() -> None:
        task = tasks.task(AccuracyTask.MULTIKEY)
        await sized_prompts(tokenizer, await shared_pieces(tokenizer, task), task.draw(0, 0), 50)

    with pytest.raises(GateError, match="alone take") as raised:
        asyncio.run(build())
    assert raised.value.reason == "LengthTooShort"
