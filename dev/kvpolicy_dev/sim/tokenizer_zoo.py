"""Tokenizers of the families real models use, built here with `tokenizers`, and model directories vLLM can serve.

No tokenizer can be downloaded on the machines this project is tested on, so each family is built on the spot
(deterministically, in well under a second) from a small corpus of the NIAH prompts' own words:

- byte-level BPE with a tiny vocabulary, Llama-3 style (regex split, bytes, `<|begin_of_text|>`): the filler's words
  are several tokens each;
- byte-level BPE with a larger vocabulary, GPT-2 style (no BOS): every filler word is one token;
- SentencePiece-style BPE (`▁` for spaces, no split on them, byte fallback, `<s>`): merges run across spaces;
- WordPiece, BERT style (lower-cased, `##` continuations, `[CLS] ... [SEP]` around every text; decoding puts spaces
  around punctuation);
- Unigram, T5 style (`▁`, `</s>` appended to every text).

`write_model_dir` saves one as a Hugging Face model directory (a tiny Llama config.json and the tokenizer files saved
by transformers' `PreTrainedTokenizerFast`), which real vLLM serves with `--load-format dummy` and the simulator
with `--tokenizer DIR`.
"""

from __future__ import annotations

import json
import math
import random
import string
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvpolicy.gate_programs import niah
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Llama-3's pre-tokenizer pattern (tiktoken cl100k): words with a leading space, numbers in groups of up to 3 digits.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


class Family(StrEnum):
    BYTE_LEVEL_BPE = "byte-level-bpe"
    GPT2_BPE = "gpt2-bpe"
    SENTENCEPIECE_BPE = "sentencepiece-bpe"
    WORDPIECE = "wordpiece"
    UNIGRAM = "unigram"


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens a family declares (as transformers names them); None where it has none."""

    bos: str | None
    eos: str
    unk: str | None


SPECIAL_TOKENS = {
    Family.BYTE_LEVEL_BPE: SpecialTokens("<|begin_of_text|>", "<|end_of_text|>", None),
    Family.GPT2_BPE: SpecialTokens(None, "<|endoftext|>", None),
    Family.SENTENCEPIECE_BPE: SpecialTokens("<s>", "</s>", "<unk>"),
    Family.WORDPIECE: SpecialTokens("[CLS]", "[SEP]", "[UNK]"),
    Family.UNIGRAM: SpecialTokens(None, "</s>", "<unk>"),
}


def training_corpus(seed: int = 0, needles: int = 400) -> list[str]:
    """The NIAH prompt's words in many lines (header, filler, needles, questions) and every printable character."""
    rng = random.Random(seed)
    lines = [niah.HEADER, niah.FILLER * 3, string.printable, " ".join(string.ascii_letters + string.digits)]
    for index in range(needles):
        sample = niah.draw_sample(seed, index, num_needles=4, num_asked=2)
        lines += [niah.NEEDLE.format(key=needle.key, value=needle.value) for needle in sample.needles]
        lines.append(niah.QUESTION.format(keys=", ".join(needle.key for needle in sample.asked)))
        lines.append(" ".join(str(rng.randrange(10**6, 10**7)) for _ in range(4)))
    return lines


def _byte_level_bpe(corpus: list[str], vocab_size: int, bos: str | None, eos: str, llama3_split: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if llama3_split:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [token for token in (bos, eos) if token]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _sentencepiece_bpe(corpus: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    # split=False: a whole line is one "word", so merges may join pieces across the `▁` that stands for a space.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
        max_token_length=24,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def _word_counts(corpus: list[str], tokenizer: Tokenizer) -> Counter[str]:
    """How often each pre-tokenized word (after the tokenizer's normalizer) occurs in the corpus."""
    counts: Counter[str] = Counter()
    for line in corpus:
        text = tokenizer.normalizer.normalize_str(line) if tokenizer.normalizer else line
        counts.update(word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text))
    return counts


# WordPiece and Unigram vocabularies are derived from counts here, not by their trainers, whose tie-breaking follows
# a randomly seeded hash map: a trained vocabulary would differ from one process to the next.


def _wordpiece(corpus: list[str]) -> Tokenizer:
    """The template's words whole; key words spelt out in `##` characters; numbers in two-digit pieces."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    template = [niah.HEADER, niah.FILLER, niah.NEEDLE.format(key="", value=""), niah.QUESTION.format(keys="")]
    characters = sorted({char for word in _word_counts(corpus, tokenizer) for char in word})
    pairs = [f"{first}{second}" for first in string.digits for second in string.digits]
    pieces = [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", *characters, *(f"##{char}" for char in characters),
        *sorted(set(_word_counts(template, tokenizer)) - set(characters)), *pairs, *(f"##{pair}" for pair in pairs),
    ]  # fmt: skip
    tokenizer.model = models.WordPiece(
        vocab={piece: index for index, piece in enumerate(dict.fromkeys(pieces))}, unk_token="[UNK]"
    )
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tokenizer


def _unigram(corpus: list[str], vocab_size: int = 600) -> Tokenizer:
    """The most frequent substrings of the corpus's `▁`-words, scored by their log frequency, and every character."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    substrings: Counter[str] = Counter()
    for word, count in _word_counts(corpus, tokenizer).items():
        for start in range(len(word)):
            for end in range(start + 1, min(len(word), start + 8) + 1):
                substrings[word[start:end]] += count
    ranked = sorted(substrings.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ranked[:vocab_size]) | {piece: count for piece, count in ranked if len(piece) == 1}
    total = sum(kept.values())
    scored = [(piece, math.log(count / total)) for piece, count in sorted(kept.items())]
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    tokenizer.model = models.Unigram(vocab=specials + scored, unk_id=2)
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tokenizer.token_to_id("</s>"))]
    )
    return tokenizer


def build(family: Family) -> Tokenizer:
    """`family`'s tokenizer, built from the NIAH corpus; the same family always gives the same vocabulary."""
    corpus = training_corpus()
    special = SPECIAL_TOKENS[family]
    if family is Family.BYTE_LEVEL_BPE:
        return _byte_level_bpe(corpus, vocab_size=300, bos=special.bos, eos=special.eos, llama3_split=True)
    if family is Family.GPT2_BPE:
        return _byte_level_bpe(corpus, vocab_size=1500, bos=None, eos=special.eos, llama3_split=False)
    if family is Family.SENTENCEPIECE_BPE:
        return _sentencepiece_bpe(corpus)
    if family is Family.WORDPIECE:
        return _wordpiece(corpus)
    return _unigram(corpus)


def llama_config(
    vocab_size: int, bos_id: int | None, eos_id: int | None, max_position_embeddings: int
) -> dict[str, object]:
    """A tiny Llama (2 layers, hidden 256, 4 query / 2 KV heads of 64): vLLM runs it with random weights on a CPU."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def write_model_dir(family: Family, directory: Path, max_position_embeddings: int = 131072) -> Path:
    """Write `family`'s tokenizer and a tiny Llama config.json into `directory` (created); return it."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = build(family)
    special = SPECIAL_TOKENS[family]
    directory.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=special.bos,
        eos_token=special.eos,
        unk_token=special.unk,
        model_max_length=max_position_embeddings,
    )
    fast.save_pretrained(directory)
    bos_id = tokenizer.token_to_id(special.bos) if special.bos else None
    config = llama_config(
        tokenizer.get_vocab_size(), bos_id, tokenizer.token_to_id(special.eos), max_position_embeddings
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
