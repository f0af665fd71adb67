"""Tokenizers of the families real models use, trained here with `tokenizers`, and model directories vLLM can serve.

No tokenizer can be downloaded on the machines this project is tested on, so each family is trained on the spot
(deterministically, in well under a second) on a small corpus of the NIAH prompts' own words:

- byte-level BPE with a tiny vocabulary, Llama-3 style (regex split, bytes, `<|begin_of_text|>`): the filler's words
  are several tokens each;
- byte-level BPE with a larger vocabulary, GPT-2 style (no BOS): every filler word is one token;
- SentencePiece-style BPE (`▁` for spaces, no split on them, byte fallback, `<s>`): merges run across spaces;
- WordPiece, BERT style (lower-cased, `##` continuations, `[CLS] ... [SEP]` around every text);
- Unigram, T5 style (`▁`, `</s>` appended to every text).

`write_model_dir` saves one as a Hugging Face model directory (a tiny Llama config.json and the tokenizer files saved
by transformers' `PreTrainedTokenizerFast`), which real vLLM serves with `--load-format dummy` and the simulator
with `--tokenizer DIR`.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from kvpolicy.gates import niah

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


def _wordpiece(corpus: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=700, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tokenizer.train_from_iterator(corpus, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tokenizer


def _unigram(corpus: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=600, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tokenizer.token_to_id("</s>"))]
    )
    return tokenizer


def build(family: Family) -> Tokenizer:
    """Train `family`'s tokenizer on the NIAH corpus; the same family always gives the same vocabulary."""
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
