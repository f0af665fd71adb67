"""A deterministic, reversible word-level tokenizer shared by the simulator and the gate tests.

Text is split GPT-2 style into pieces (a word with its leading space, a run of punctuation, or whitespace); a piece in
the fixed vocabulary is one token, anything else falls back to one token per UTF-8 byte, so every text round-trips.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

_PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")
_BYTE_TOKENS = 256

# Words of the RULER-style haystack, needles, questions and the simulator's filler answers; digits are single tokens.
_WORDS = (
    "the", "a", "an", "and", "or", "of", "for", "to", "in", "on", "at", "is", "are", "was", "be", "it", "its",
    "this", "that", "with", "as", "by", "from", "into", "about", "after", "again", "all", "any", "back", "there",
    "here", "we", "go", "grass", "sky", "sun", "green", "blue", "yellow", "some", "special", "magic", "number",
    "numbers", "hidden", "within", "following", "text", "make", "sure", "memorize", "i", "will", "quiz", "you",
    "afterwards", "what", "mentioned", "provided", "one", "two", "three", "four", "answer", "question", "context",
    "key", "keys", "value", "values", "remember", "given", "read", "find", "report", "only", "nothing", "else",
    "ok", "yes", "no"
)  # fmt: skip


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[list[str], dict[str, int]]:
    pieces: list[str] = []
    for word in _WORDS:
        for variant in (word, word.capitalize()):
            pieces += [variant, " " + variant]
    pieces += [str(d) for d in range(10)] + [f" {d}" for d in range(10)]
    pieces += [".", ",", ":", "?", "-", " -", "\n", "\n\n", " "]
    unique = list(dict.fromkeys(pieces))
    return unique, {piece: _BYTE_TOKENS + i for i, piece in enumerate(unique)}


def pieces(text: str) -> list[str]:
    """Split text into pre-tokenizer pieces (concatenating them gives the text back)."""
    return _PIECE.findall(text)


def encode(text: str) -> list[int]:
    _, ids = _vocabulary()
    tokens: list[int] = []
    for piece in pieces(text):
        token = ids.get(piece)
        if token is None:
            tokens.extend(piece.encode())
        else:
            tokens.append(token)
    return tokens


def count(text: str) -> int:
    _, ids = _vocabulary()
    return sum(1 if piece in ids else len(piece.encode()) for piece in pieces(text))


def decode(tokens: Iterable[int]) -> str:
    """Inverse of `encode`; raises ValueError naming the first id outside the vocabulary."""
    vocab, _ = _vocabulary()
    out = bytearray()
    for token in tokens:
        if 0 <= token < _BYTE_TOKENS:
            out.append(token)
        elif _BYTE_TOKENS <= token < _BYTE_TOKENS + len(vocab):
            out += vocab[token - _BYTE_TOKENS].encode()
        else:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{vocab_size() - 1})")
    return out.decode(errors="replace")


def vocab_size() -> int:
    return _BYTE_TOKENS + len(_vocabulary()[0])
