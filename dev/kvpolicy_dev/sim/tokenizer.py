"""The simulator's tokenizers: a built-in word-level one, or a Hugging Face tokenizer.json (`--tokenizer`).

The built-in tokenizer is deterministic and reversible: text is split GPT-2 style into pieces (a word with its leading
space, a run of punctuation, or whitespace); a piece in the fixed vocabulary is one token, anything else falls back to
one token per UTF-8 byte, so every text round-trips. It adds no special tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

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


class Tokenizer(Protocol):
    """What the simulator needs of a tokenizer. `add_special_tokens` adds what the server adds to a text prompt
    (a BOS, or [CLS] ... [SEP]), as vLLM's /tokenize and /v1/completions do by default."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str:
        """Raise ValueError naming the first id outside the vocabulary."""
        ...


class WordTokenizer:
    """The built-in tokenizer (this module's functions) as a `Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return decode(tokens)


class HuggingFaceTokenizer:
    """A `tokenizer.json` (the file transformers' fast tokenizers save) loaded with the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ValueError("--tokenizer needs the `tokenizers` package (pip install tokenizers)") from None
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there (give a model directory or the file)")
        try:
            self._tokenizer = _Tokenizer.from_file(str(file))
        except Exception as error:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"--tokenizer {path}: {file} is not a tokenizer.json ({error})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, tokens: Sequence[int]) -> str:
        for token in tokens:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})")
        text: str = self._tokenizer.decode(list(tokens), skip_special_tokens=True)
        return text


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The built-in tokenizer for None, else the Hugging Face tokenizer at `path`; ValueError says what is wrong."""
    return WordTokenizer() if path is None else HuggingFaceTokenizer(path)
