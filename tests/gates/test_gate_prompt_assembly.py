"""Prompt sizing in token space: exact length for any pieces and any tokenizer, needles whole, always terminating."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy.gate_programs import niah
from kvpolicy.gate_programs.accuracy import sample_pieces, shared_pieces, sized_prompt, split_special_tokens
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
        question=tuple(draw(token_lists)),
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
    tokens = niah.assemble(pieces, depths, length)
    assert len(tokens) == length
    head = [*pieces.prefix, *pieces.header]
    tail = [*pieces.question, *pieces.suffix]
    assert tokens[: len(head)] == head
    assert tokens[len(tokens) - len(tail) :] == tail
    # Walk the middle: the haystack is the filler sentences repeated and cut to fit, with the needles, in order and
    # whole, at the sentence end nearest their depth (or at the very end).
    middle = tokens[len(head) : len(tokens) - len(tail)]
    filler = cyclic_filler(pieces.sentences, extra)
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
        assert abs(used - target) == min(abs(boundary - target) for boundary in boundaries), "a needle off its depth"
        assert middle[position : position + len(needle)] == list(needle), "a needle cut"
        position += len(needle)
    assert middle[position:] == filler[used:]


def test_a_length_below_the_fixed_pieces_is_refused() -> None:
    pieces = niah.PromptPieces((1,), (), (2, 3), ((4,),), ((5, 6),), (7,))
    assert len(niah.assemble(pieces, (0.5,), pieces.fixed_tokens)) == pieces.fixed_tokens
    with pytest.raises(ValueError, match="alone take 6 tokens"):
        niah.assemble(pieces, (0.5,), 5)
    with pytest.raises(ValueError, match="every filler sentence must tokenize to at least one token"):
        niah.PromptPieces((), (), (), ((),), ((1,),), ())


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
@settings(max_examples=15, deadline=None)
@given(index=st.integers(0, 10_000), extra=st.integers(0, 40_000))
def test_every_tokenizer_family_gives_the_exact_length_and_readable_needles(
    family: Family, index: int, extra: int
) -> None:
    tokenizer = LocalTokenizer(family)
    sample = niah.draw_sample(seed=3, index=index)

    async def build() -> tuple[int, list[int]]:
        shared = await shared_pieces(tokenizer)
        shortest = (await sample_pieces(tokenizer, shared, sample)).fixed_tokens
        return shortest + extra, await sized_prompt(tokenizer, shared, sample, shortest + extra)

    length, prompt = asyncio.run(build())
    assert len(prompt) == length
    needles, asked = niah.parse_prompt(tokenizer.decode(prompt))
    assert needles == {needle.key: needle.value for needle in sample.needles}
    assert asked == tuple(needle.key for needle in sample.asked)


def test_a_length_too_short_for_the_needles_says_how_many_tokens_they_take() -> None:
    tokenizer = LocalTokenizer(FAMILIES[0])

    async def build() -> None:
        await sized_prompt(tokenizer, await shared_pieces(tokenizer), niah.draw_sample(0, 0), 50)

    with pytest.raises(GateError, match="alone take") as raised:
        asyncio.run(build())
    assert raised.value.reason == "LengthTooShort"
