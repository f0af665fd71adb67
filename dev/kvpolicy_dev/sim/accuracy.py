"""Long-context retrieval accuracy of a simulated server: the model's own capability times a numerics factor.

P(a needle is answered correctly at prompt length L) = capability(L) · survival(e(L)), where
- capability(L) = 1 - 0.09·sqrt(L / 128k) is the model's own curve (≈ 91% at 128k, the published BF16 score);
- e(L) is the emulated attention error (kvpolicy_dev.numerics) of the worst layer of this server's configuration, each
  layer at its own context (sliding-window layers see at most their window);
- survival(e) = exp(-(e / NUMERICS_TOLERANCE)^RETRIEVAL_STEEPNESS): retrieval tolerates small output errors and breaks
  sharply past the tolerance. NUMERICS_TOLERANCE is the one calibrated parameter (unfixed FP8 on Hopper at 128k scores
  ≈ 13%); the fixed steepness keeps FP8 near BF16 through 32k, the published shape. Two-level FP8 lands at BF16's
  ≈ 91% (published: 89%); its emulated error is BF16's, so the 2-point gap is not something the numerics produce.
- an FP8 layer's error adds, in quadrature, the configured `kv_scale_error`: the error uncalibrated KV scales cost at
  every length. It is flat in length, so it shifts every length bucket alike: 0.30 keeps ≈ 98% of needles.
Draws are deterministic: the capability draw depends only on the needle and the length (the same model fails the
same hard prompts on every server), the numerics draw also on the server's seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvpolicy.gate_programs.mrcr import ASK

from kvpolicy_dev.numerics import Accumulation, attention_error
from kvpolicy_dev.numerics import accumulation as accumulation_module
from kvpolicy_dev.numerics import probe as probe_module
from kvpolicy_dev.sim.config import SimConfig

CAPABILITY_LOSS_AT_128K = 0.09
NUMERICS_TOLERANCE = 0.496
RETRIEVAL_STEEPNESS = 8
# The emulator runs at powers of two (from one KV tile up) and is interpolated in log2(length) between them.
_SMALLEST_EMULATED_LENGTH = 128
# The emulation is deterministic, so simulators in one process (tests, the demo) share results, and simulator
# processes share them through files named after the emulator's source (an edited emulator never reads stale ones).
_PROCESS_CACHE: dict[tuple[Accumulation, int, int], float] = {}
CACHE_DIR_ENV = "KVPOLICY_CACHE_DIR"
_EMULATOR_DIGEST = hashlib.sha256(
    b"".join(Path(module.__file__ or "").read_bytes() for module in (accumulation_module, probe_module))
).hexdigest()[:16]


def _cache_file(accumulation: Accumulation, length: int, head_dim: int) -> Path:
    root = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kvpolicy")
    return root / f"attention-error-{_EMULATOR_DIGEST}-{accumulation.value}-{length}-{head_dim}.json"


def emulated_error(accumulation: Accumulation, length: int, head_dim: int) -> float:
    """The emulator's relative attention error, from the file cache when an earlier process computed it."""
    path = _cache_file(accumulation, length, head_dim)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return float(json.loads(path.read_text())["relative"])
    relative = attention_error(accumulation, length, head_dim).relative
    # Best effort: a read-only or full disk only costs the next process a recomputation.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"relative": relative}))
        partial.replace(path)
    return relative


def capability(prompt_tokens: int) -> float:
    return max(0.0, 1.0 - CAPABILITY_LOSS_AT_128K * math.sqrt(prompt_tokens / 131072))


def survival(attention_error: float) -> float:
    return math.exp(-((attention_error / NUMERICS_TOLERANCE) ** RETRIEVAL_STEEPNESS))


def _grid(length: int) -> tuple[int, int, float]:
    """Neighbouring power-of-two emulation lengths and the interpolation weight of the upper one."""
    position = math.log2(max(length, _SMALLEST_EMULATED_LENGTH))
    lower = 2 ** math.floor(position)
    upper = 2 ** math.ceil(position)
    return lower, upper, (position - math.log2(lower)) if upper != lower else 0.0


class NumericsModel:
    """Attention error per prompt length for one server configuration, emulated once per grid point and cached."""

    def __init__(self, config: SimConfig) -> None:
        self._config = config
        self._errors: dict[tuple[Accumulation, int], asyncio.Task[float]] = {}

    def _emulated(self, accumulation: Accumulation, length: int) -> asyncio.Task[float]:
        key = (accumulation, length)
        if key not in self._errors:
            self._errors[key] = asyncio.create_task(self._emulate(accumulation, length))
        return self._errors[key]

    async def _emulate(self, accumulation: Accumulation, length: int) -> float:
        key = (accumulation, length, self._config.head_dim)
        if key not in _PROCESS_CACHE:
            # The emulator holds the GIL only in short stretches; a thread keeps /health and streams responsive.
            _PROCESS_CACHE[key] = await asyncio.to_thread(emulated_error, *key)
        return _PROCESS_CACHE[key]

    async def _layer_error(self, accumulation: Accumulation, context: int) -> float:
        lower, upper, weight = _grid(context)
        low = await self._emulated(accumulation, lower)
        high = await self._emulated(accumulation, upper)
        return (1.0 - weight) * low + weight * high

    async def attention_error(self, prompt_tokens: int) -> float:
        """The worst layer's emulated relative error of the attention output at this prompt length."""
        layers = {
            (self._config.layer_accumulation(layer), self._config.layer_context(layer, prompt_tokens))
            for layer in range(self._config.num_layers)
        }
        errors = [
            math.hypot(await self._layer_error(accumulation, context), self._scale_error(accumulation))
            for accumulation, context in sorted(layers)
        ]
        return max(errors)

    def _scale_error(self, accumulation: Accumulation) -> float:
        return self._config.kv_scale_error if accumulation.is_fp8 else 0.0

    async def retrieval_probability(self, prompt_tokens: int) -> tuple[float, float]:
        """(capability, numerics survival) of one needle at this prompt length."""
        return capability(prompt_tokens), survival(await self.attention_error(prompt_tokens))


def _uniform(*parts: object) -> float:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def answer_needles(
    needles: dict[str, tuple[str, ...]],
    asked: tuple[str, ...],
    prompt_tokens: int,
    capability_p: float,
    survival_p: float,
    seed: int,
) -> str:
    """The simulated model's answer to a question for the `asked` keys of a prompt holding `needles` (each key's
    values: one, or several for RULER's niah_multivalue). Each value is recalled on its own draws."""
    values = []
    for key in asked:
        own = needles.get(key, ())
        for truth in own or (None,):
            remembered = _uniform("capability", key, truth, prompt_tokens) < capability_p
            intact = _uniform("numerics", seed, key, truth, prompt_tokens) < survival_p
            if truth is not None and remembered and intact:
                values.append(truth)
            else:
                # A wrong answer is a distractor from the haystack when there is one, else a made-up number.
                others = sorted({value for group in needles.values() for value in group if value not in own})
                pick = _uniform("wrong", seed, key, truth, prompt_tokens)
                values.append(others[int(pick * len(others))] if others else str(1_000_000 + int(pick * 9_000_000)))
    return " " + ", ".join(values) + "."


@dataclass(frozen=True)
class ConversationAsk:
    """An MRCR-style final ask in a chat (gate_programs/mrcr.py): the prefix to prepend, which of the identical
    asks' answers it wants (0-based), those answers in order, and every other assistant answer."""

    prefix: str
    index: int
    answers: tuple[str, ...]
    others: tuple[str, ...]


_CHATML_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.S)
_FINAL = re.compile(r"Prepend (\S+) to the (\d+)(?:st|nd|rd|th) \(1 indexed\) (.+?) about (\w+)\.")


def parse_conversation(text: str) -> ConversationAsk | None:
    """The MRCR ask a ChatML-rendered chat ends with, or None when it is no such chat."""
    turns = _CHATML_TURN.findall(text)
    if not turns or turns[-1][0] != "user":
        return None
    final = _FINAL.match(turns[-1][1])
    if final is None:
        return None
    prefix, ordinal, form, topic = final.groups()
    ask = ASK.format(form=form, topic=topic)
    answers: list[str] = []
    others: list[str] = []
    for (role, content), (next_role, reply) in itertools.pairwise(turns[:-1]):
        if role == "user" and next_role == "assistant":
            (answers if content == ask else others).append(reply)
    return ConversationAsk(prefix, int(ordinal) - 1, tuple(answers), tuple(others))


def answer_conversation(
    ask: ConversationAsk, prompt_tokens: int, capability_p: float, survival_p: float, seed: int
) -> str:
    """The simulated model's reply to an MRCR ask: the prefix and the asked answer when recalled, else the prefix and
    another of the identical asks' answers (or a distractor's): MRCR's hard mistake."""
    truth = ask.answers[ask.index] if 0 <= ask.index < len(ask.answers) else None
    remembered = _uniform("capability", ask.prefix, truth, prompt_tokens) < capability_p
    intact = _uniform("numerics", seed, ask.prefix, truth, prompt_tokens) < survival_p
    if truth is not None and remembered and intact:
        return ask.prefix + truth
    wrong = [answer for answer in ask.answers if answer != truth] or list(ask.others) or ["I cannot find it."]
    return ask.prefix + wrong[int(_uniform("wrong", seed, ask.prefix, prompt_tokens) * len(wrong))]
