"""The long-context accuracy gate: does the canary keep the baseline's needle-retrieval score at N tokens?

Canary and baseline answer the same seeded prompts of the policy's task (tasks.py: the RULER-style mix by default,
asking each of a haystack's needles in a request of its own, one of RULER's niah tasks, or MRCR's format) of exactly
N tokens. With chat prompts (PromptFormat Chat, or Auto on a model with a chat template) each prompt is a chat sized
instead by /tokenize with the messages to the longest that fits in N (`sized_chat`). Each completion prompt is built
in token space (niah.assemble) from pieces the baseline's /tokenize gave once, and sent as token ids, so its length
is exact for any tokenizer by construction, never by trial; the canary must tokenize the shared pieces the same way,
and each server's usage.prompt_tokens must confirm N. A sample's first request goes alone and the rest follow
together, so a server with prefix caching (vLLM's default) prefills the haystack once per sample. After every prompt
the sequential tests of stats are read: the gate passes once recovery is shown above min_recovery, fails once it is
shown below, each wrong with probability at most 1 - confidence however early it stops. A baseline shown to score below
baseline_floor at this length cannot judge a canary: that is inconclusive (BaselineTooWeak), never a pass or a fail,
and so is a pass or fail the baseline's score so far is below the floor for. At the sample cap it is inconclusive. An
endpoint that keeps failing makes the result inconclusive, never a pass.

With a length profile (`length_buckets` > 1; see length_profile) every round also sends the same sample at the
shorter bucket lengths, beside the prompt at N and at the same time; only the prompts at N feed the stopping rule, so
the decision comes after as many of them as without a profile. The report adds each bucket's scores, the AUC across
them and the systematic-shift test, read when the gate stops.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpolicy.api.reasons import GateReason
from kvpolicy.api.v1alpha1 import (
    MAX_PROFILE_BUCKETS,
    AccuracyGate,
    AccuracyTask,
    LengthBucketResult,
    LengthProfileResult,
    PromptFormat,
    parse_decimal,
)
from kvpolicy.credentials import CredentialsError, CredentialsSource
from kvpolicy.gate_programs import length_profile, niah, tasks
from kvpolicy.gate_programs.client import RETRY_DELAYS_S, GateError, VllmClient, open_session
from kvpolicy.gate_programs.length_profile import Bucket, Profile
from kvpolicy.gate_programs.pacing import paced
from kvpolicy.gate_programs.stats import Evidence, PairedCounts, RecoveryBounds

# The CRD's defaults are the gate's: one source.
CRD_DEFAULTS = AccuracyGate()


@dataclass(frozen=True)
class AccuracyOptions:
    canary: str
    baseline: str
    length: int
    model: str
    min_recovery: float = parse_decimal(CRD_DEFAULTS.min_recovery)
    confidence: float = parse_decimal(CRD_DEFAULTS.confidence)
    max_samples: int = CRD_DEFAULTS.max_samples
    baseline_floor: float = parse_decimal(CRD_DEFAULTS.baseline_floor)
    min_samples: int = 2
    seed: int = 0
    request_timeout_seconds: float = 600.0
    task: AccuracyTask = CRD_DEFAULTS.task
    prompt_format: PromptFormat = CRD_DEFAULTS.prompt_format
    mrcr_needles: int = CRD_DEFAULTS.mrcr_needles
    needles: int = 8
    asked: int = 8
    retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S
    baseline_requests_per_minute: int | None = CRD_DEFAULTS.baseline_requests_per_minute
    length_buckets: int = CRD_DEFAULTS.length_profile.buckets

    @property
    def lengths(self) -> tuple[int, ...]:
        """The profile's bucket lengths, shortest first; the last is `length`, the one the gate decides at."""
        return length_profile.bucket_lengths(self.length, self.length_buckets)


@dataclass(frozen=True)
class AccuracyProgress:
    """Where a running gate stands after each prompt (for a person watching `kvpolicy gate`)."""

    samples: int
    counts: PairedCounts
    interval: RecoveryBounds
    options: AccuracyOptions


@dataclass(frozen=True)
class SharedPieces:
    """The prompt pieces every sample shares, as one endpoint's tokenizer gives them."""

    prefix: niah.TokenIds
    suffix: niah.TokenIds
    header: niah.TokenIds
    sentences: tuple[niah.TokenIds, ...]


def split_special_tokens(with_special: list[int], without: list[int]) -> tuple[niah.TokenIds, niah.TokenIds]:
    """The special tokens a server puts before and after a text (a BOS, [CLS] ... [SEP], a T5 </s>): what
    tokenizing with them adds around tokenizing without. None of it when `without` is not found whole inside."""
    for start in range(len(with_special) - len(without) + 1):
        if with_special[start : start + len(without)] == without:
            return tuple(with_special[:start]), tuple(with_special[start + len(without) :])
    raise ValueError("the tokens with special tokens do not contain the tokens without them")


class Tokenizing(Protocol):
    """What building prompts needs of an endpoint (a VllmClient; in tests, a local tokenizer)."""

    base_url: str

    async def tokenize(self, prompt: str, add_special_tokens: bool) -> list[int]: ...

    async def tokenize_chat(self, messages: list[niah.Message]) -> list[int]: ...


async def shared_pieces(client: Tokenizing, task: tasks.Task, seed: int = 0) -> SharedPieces:
    """The pieces every sample of `task` shares (its header, its haystack's units), as `client` tokenizes them."""
    units = task.units(seed)
    with_special, header, *filler = await asyncio.gather(
        client.tokenize(task.header, add_special_tokens=True),
        client.tokenize(task.header, add_special_tokens=False),
        *(client.tokenize(unit, add_special_tokens=False) for unit in units),
    )
    if not all(filler):
        raise GateError(GateReason.MALFORMED_RESPONSE, f"{client.base_url} tokenized a filler sentence to no tokens")
    try:
        prefix, suffix = split_special_tokens(with_special, header)
    except ValueError:
        raise GateError(
            GateReason.TOKENIZER_UNSUPPORTED,
            f"{client.base_url}'s special tokens change the text's own tokens: cannot build prompts as token ids",
        ) from None
    return SharedPieces(prefix, suffix, tuple(header), tuple(tuple(ids) for ids in filler))


async def sample_pieces(client: Tokenizing, shared: SharedPieces, sample: niah.TaskSample) -> niah.PromptPieces:
    """`sample`'s prompt pieces: the shared ones (its haystack's units in its order), and its needles and questions
    as `client` tokenizes them."""
    tokenized = await asyncio.gather(
        *(client.tokenize(needle, add_special_tokens=False) for needle in sample.needles),
        *(client.tokenize(question.text, add_special_tokens=False) for question in sample.questions),
    )
    needles = tokenized[: len(sample.needles)]
    if not all(needles):
        raise GateError(GateReason.MALFORMED_RESPONSE, f"{client.base_url} tokenized a needle to no tokens")
    order = sample.unit_order
    sentences = shared.sentences if order is None else tuple(shared.sentences[i] for i in order)
    return niah.PromptPieces(
        prefix=shared.prefix,
        suffix=shared.suffix,
        header=shared.header,
        sentences=sentences,
        needles=tuple(tuple(ids) for ids in needles),
        questions=tuple(tuple(ids) for ids in tokenized[len(sample.needles) :]),
    )


async def sized_prompts(
    client: Tokenizing, shared: SharedPieces, sample: niah.TaskSample, length: int
) -> list[list[int]]:
    """`sample`'s prompts (one per question), each exactly `length` token ids for `client`'s tokenizer, needles
    whole (see niah.assemble)."""
    [prompts] = await profile_prompts(client, shared, sample, (length,))
    return prompts


async def profile_prompts(
    client: Tokenizing, shared: SharedPieces, sample: niah.TaskSample, lengths: tuple[int, ...]
) -> list[list[list[int]]]:
    """`sample`'s prompts at each of `lengths` (see `sized_prompts`), its pieces tokenized once for all of them."""
    pieces = await sample_pieces(client, shared, sample)
    shortest = min(lengths)
    if pieces.fixed_tokens > shortest:
        bucket = f"the length profile's shortest bucket, {shortest}," if len(lengths) > 1 else f"length {shortest}"
        raise GateError(
            GateReason.LENGTH_TOO_SHORT,
            f"{bucket} leaves no room for haystack: the header, needles and question alone take "
            f"{pieces.fixed_tokens} tokens",
        )
    return [niah.assemble(pieces, sample.depths, length) for length in lengths]


def _number(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 4)


def profile_result(profile: Profile) -> LengthProfileResult:
    """The profile as the report and the status carry it."""
    return LengthProfileResult(
        buckets=[
            LengthBucketResult(
                length_tokens=bucket.length,
                prompts=bucket.prompts,
                needles=bucket.counts.total,
                canary_score=_number(bucket.counts.canary_score),
                baseline_score=_number(bucket.counts.baseline_score),
                recovery=_number(bucket.counts.recovery),
                canary_only=bucket.counts.canary_only,
                baseline_only=bucket.counts.baseline_only,
            )
            for bucket in profile.buckets
        ],
        canary_auc=_number(profile.canary_auc),
        baseline_auc=_number(profile.baseline_auc),
        auc_recovery=_number(profile.auc_recovery),
        systematic_shift=profile.shift.systematic,
        # A p-value is small where it matters: keep its significant digits, not 4 decimals.
        shift_p_value=float(f"{profile.shift.p_value:.3g}"),
        negative_buckets=profile.shift.negative_buckets,
    )


def shift_message(profile: Profile) -> str:
    """What a flagged systematic shift adds to the gate's message (empty when none is flagged)."""
    shift = profile.shift
    if not shift.systematic:
        return ""
    lengths = ", ".join(str(bucket.length) for bucket in profile.buckets)
    return (
        f"; systematic shift: the canary is below the baseline in all {shift.buckets} length buckets ({lengths} "
        f"tokens; {shift.baseline_only} needles only the baseline found, {shift.canary_only} only the canary; sign "
        f"test p = {shift.p_value:.2g}): calibrate the KV scales (an LLM-Compressor checkpoint with KV scales, "
        f"kvCache.scales Calibrated)"
    )


def _result(
    options: AccuracyOptions,
    verdict: str,
    reason: str,
    message: str,
    samples: int = 0,
    counts: PairedCounts | None = None,
    interval: RecoveryBounds | None = None,
    profile: Profile | None = None,
) -> dict[str, Any]:
    number = _number
    extra: dict[str, Any] = {}
    if profile is not None:
        extra["profile"] = profile_result(profile).model_dump(mode="json", by_alias=True)
        message += shift_message(profile)
    return {
        "gate": "accuracy",
        "verdict": verdict,
        "reason": reason,
        "message": message,
        "task": options.task.value,
        "promptFormat": options.prompt_format.value,
        "lengthTokens": options.length,
        "samples": samples,
        "canaryScore": number(counts.canary_score) if counts else None,
        "baselineScore": number(counts.baseline_score) if counts else None,
        "recovery": number(interval.point) if interval else None,
        "recoveryLow": number(interval.low) if interval else None,
        "recoveryHigh": number(interval.high) if interval else None,
        "minRecovery": options.min_recovery,
        "confidence": options.confidence,
        "baselineFloor": options.baseline_floor,
        **extra,
    }


def sequential_decision(evidence: Evidence, samples: int, options: AccuracyOptions) -> GateReason | None:
    """The gate's decision after `samples` prompts, or None to ask another prompt. SampleCapReached and
    BaselineTooWeak are inconclusive."""
    alpha = 1 - options.confidence
    counts = evidence.counts
    if samples >= options.min_samples:
        if evidence.baseline_too_weak(alpha):
            return GateReason.BASELINE_TOO_WEAK
        # Each test alone is valid; asking the point estimate to agree only makes decisions rarer, and keeps a
        # result from reading "recovery 0.93 ... above 0.95".
        point = counts.recovery
        if counts.baseline_score >= options.baseline_floor and point is not None:
            if evidence.above_bar(alpha) and point >= options.min_recovery:
                return GateReason.RECOVERY_ABOVE_THRESHOLD
            if evidence.below_bar(alpha) and point < options.min_recovery:
                return GateReason.RECOVERY_BELOW_THRESHOLD
    if samples < options.max_samples:
        return None
    if counts.baseline_score < options.baseline_floor:
        return GateReason.BASELINE_TOO_WEAK
    return GateReason.SAMPLE_CAP_REACHED


VERDICTS = {GateReason.RECOVERY_ABOVE_THRESHOLD: "Pass", GateReason.RECOVERY_BELOW_THRESHOLD: "Fail"}


def decision_message(reason: GateReason, evidence: Evidence, samples: int, options: AccuracyOptions) -> str:
    bounds = evidence.bounds(1 - options.confidence)
    point = "n/a" if bounds.point is None else f"{bounds.point:.3f}"
    scores = f"canary {evidence.counts.canary_score:.3f}, baseline {evidence.counts.baseline_score:.3f}"
    after = f"after {samples} prompts ({evidence.counts.total} needles; {scores})"
    if reason == GateReason.BASELINE_TOO_WEAK:
        return (
            f"the baseline answers too few needles at {options.length} tokens to judge the canary {after}, below "
            f"the floor {options.baseline_floor}: pick an easier task (fewer needles hidden per prompt) or a shorter "
            f"length (gates.accuracy.lengthTokens)"
        )
    if reason == GateReason.SAMPLE_CAP_REACHED:
        return (
            f"{after} recovery {point} is neither shown above nor below {options.min_recovery} "
            f"(interval {bounds.low:.2f}-{bounds.high:.2f})"
        )
    side = "above" if reason == GateReason.RECOVERY_ABOVE_THRESHOLD else "below"
    return f"recovery {point} (interval {bounds.low:.2f}-{bounds.high:.2f}) {after} lies {side} {options.min_recovery}"


@dataclass(frozen=True)
class ChatPrompt:
    """A chat prompt and its length through the chat template, with the generation prompt (what /tokenize counted)."""

    messages: list[niah.Message]
    tokens: int


Prompt = list[int] | ChatPrompt


async def sized_chat(client: Tokenizing, build: Callable[[int], list[niah.Message]], length: int) -> ChatPrompt:
    """The chat `build(words)` with the most haystack words whose templated prompt is at most `length` tokens, as
    the server's /tokenize counts it with the messages and the generation prompt (a binary search on the words: each
    word adds tokens, so the count grows with them). LengthTooShort when the chat without haystack is too long."""

    async def count(words: int) -> int:
        return len(await client.tokenize_chat(build(words)))

    fixed = await count(0)
    if fixed > length:
        raise GateError(
            GateReason.LENGTH_TOO_SHORT,
            f"length {length} leaves no room for haystack: the chat without it takes {fixed} tokens",
        )
    # Every word is at least one token, so `length - fixed` words reach the length; the search keeps
    # count(low) <= length < count(high).
    low, high = 0, length - fixed + 1
    while high - low > 1:
        middle = (low + high) // 2
        if await count(middle) <= length:
            low = middle
        else:
            high = middle
    return ChatPrompt(build(low), await count(low))


async def _prompt_format(
    canary: VllmClient, baseline: VllmClient, task: tasks.Task, requested: PromptFormat
) -> PromptFormat:
    """Chat or Completion: Auto is Chat when both servers' models have a chat template."""
    if requested == PromptFormat.COMPLETION and not task.chat_only:
        return PromptFormat.COMPLETION
    templates = await asyncio.gather(canary.has_chat_template(), baseline.has_chat_template())
    if all(templates):
        return PromptFormat.CHAT
    if requested == PromptFormat.AUTO and not task.chat_only:
        return PromptFormat.COMPLETION
    missing = ", ".join(
        dict.fromkeys(c.base_url for c, has in zip((canary, baseline), templates, strict=True) if not has)
    )
    raise GateError(
        GateReason.CHAT_TEMPLATE_MISSING,
        f"{missing} serves a model without a chat template: task {task.name} needs chat prompts",
    )


async def _check_endpoints(
    canary: VllmClient, baseline: VllmClient, length: int, task: tasks.Task, options: AccuracyOptions
) -> tuple[PromptFormat, SharedPieces | None]:
    """Both serve the model with room for the prompt and tokenize alike; how the prompts go, and the baseline's
    shared pieces for completions."""
    limits = await asyncio.gather(canary.max_model_len(), baseline.max_model_len())
    for client, limit in zip((canary, baseline), limits, strict=True):
        if length + task.answer_tokens > limit:
            raise GateError(
                GateReason.LENGTH_EXCEEDS_MAX_MODEL_LEN,
                f"{client.base_url} serves at most {limit} tokens; a {length}-token prompt plus "
                f"{task.answer_tokens} answer tokens does not fit (lower --length or raise --max-model-len)",
            )
    prompt_format = await _prompt_format(canary, baseline, task, options.prompt_format)
    mismatch = GateError(
        GateReason.TOKENIZER_MISMATCH,
        "canary and baseline tokenize the same text differently: they serve other tokenizers",
    )
    if prompt_format == PromptFormat.CHAT:
        probe = [{"role": "user", "content": niah.HEADER + niah.FILLER}]
        canary_ids, baseline_ids = await asyncio.gather(canary.tokenize_chat(probe), baseline.tokenize_chat(probe))
        if canary_ids != baseline_ids:
            raise mismatch
        return prompt_format, None
    canary_pieces, baseline_pieces = await asyncio.gather(
        shared_pieces(canary, task, options.seed), shared_pieces(baseline, task, options.seed)
    )
    if canary_pieces != baseline_pieces:
        raise mismatch
    return prompt_format, baseline_pieces


async def _answers(client: VllmClient, prompts: list[Prompt], answer_tokens: int) -> list[str]:
    """One sample's answers: the first prompt alone, so the server caches the haystack they share, then the rest."""
    first = await _answer(client, prompts[0], answer_tokens)
    return [first, *await asyncio.gather(*(_answer(client, prompt, answer_tokens) for prompt in prompts[1:]))]


async def _answer(client: VllmClient, prompt: Prompt, answer_tokens: int) -> str:
    """The answer's text (a chat's without a leading reasoning block), once the server confirms it saw exactly the
    prompt's tokens."""
    if isinstance(prompt, ChatPrompt):
        completion, expected = await client.chat(prompt.messages, answer_tokens), prompt.tokens
    else:
        completion, expected = await client.complete(prompt, answer_tokens), len(prompt)
    if completion.prompt_tokens is not None and completion.prompt_tokens != expected:
        raise GateError(
            GateReason.PROMPT_LENGTH_MISMATCH,
            f"{client.base_url} counted {completion.prompt_tokens} prompt tokens for a {expected}-token prompt",
        )
    return niah.strip_thinking(completion.text) if isinstance(prompt, ChatPrompt) else completion.text


async def _evaluate(
    options: AccuracyOptions,
    canary: VllmClient,
    baseline: VllmClient,
    on_progress: Callable[[AccuracyProgress], None],
) -> dict[str, Any]:
    needles = options.mrcr_needles if options.task == AccuracyTask.MRCR else options.needles
    task = tasks.task(options.task, needles, options.asked)
    prompt_format, shared = await _check_endpoints(canary, baseline, options.length, task, options)
    lengths = options.lengths

    async def prepare(index: int) -> tuple[niah.TaskSample, list[list[Prompt]]]:
        sample = task.draw(options.seed, index)
        if shared is not None:
            completions = await profile_prompts(baseline, shared, sample, lengths)
            return sample, [list[Prompt](bucket) for bucket in completions]

        def build(question: niah.Question) -> Callable[[int], list[niah.Message]]:
            return lambda words: task.chat(options.seed, sample, question, words)

        chats = [
            list[Prompt](await asyncio.gather(*(sized_chat(baseline, build(q), length) for q in sample.questions)))
            for length in lengths
        ]
        return sample, chats

    def score(sample: niah.TaskSample, canary_texts: list[str], baseline_texts: list[str]) -> list[tuple[bool, bool]]:
        """(canary right, baseline right) for each answer a sample's questions expect (string_match_all's parts)."""
        pairs: list[tuple[bool, bool]] = []
        for question, canary_text, baseline_text in zip(sample.questions, canary_texts, baseline_texts, strict=True):
            pairs += zip(
                task.score(canary_text, question.expected),
                task.score(baseline_text, question.expected),
                strict=True,
            )
        return pairs

    evidence = Evidence.start(options.min_recovery, options.baseline_floor)
    # The shorter buckets' needles; the longest bucket's are `evidence.counts`.
    shorter = [PairedCounts() for _ in lengths[:-1]]
    # The next prompt is sized while both servers answer the current one.
    upcoming = asyncio.create_task(prepare(0))
    samples = 0
    try:
        while True:  # sequential_decision ends it at max_samples at the latest
            sample, prompts = await upcoming
            samples += 1
            if samples < options.max_samples:
                upcoming = asyncio.create_task(prepare(samples))
            # Every bucket's prompts at once: the shorter ones ride beside the one the decision waits for.
            answers = await asyncio.gather(
                *(_answers(client, bucket, task.answer_tokens) for bucket in prompts for client in (canary, baseline))
            )
            for index in range(len(lengths)):
                pairs = score(sample, answers[2 * index], answers[2 * index + 1])
                for canary_right, baseline_right in pairs:
                    if index == len(lengths) - 1:
                        evidence = evidence.add(canary_right, baseline_right)
                    else:
                        shorter[index] = shorter[index].add(canary_right, baseline_right)
            bounds = evidence.bounds(1 - options.confidence)
            on_progress(AccuracyProgress(samples, evidence.counts, bounds, options))
            reason = sequential_decision(evidence, samples, options)
            if reason is not None:
                message = decision_message(reason, evidence, samples, options)
                verdict = VERDICTS.get(reason, "Inconclusive")
                profile = None
                if len(lengths) > 1:
                    buckets = [Bucket(length, samples, c) for length, c in zip(lengths, shorter, strict=False)]
                    buckets.append(Bucket(options.length, samples, evidence.counts))
                    profile = length_profile.profile(buckets, 1 - options.confidence)
                result = _result(options, verdict, reason, message, samples, evidence.counts, bounds, profile)
                return {**result, "promptFormat": prompt_format.value}
    finally:
        # A prompt sized ahead but not needed: stop it, and mark any error it ended with as retrieved.
        upcoming.cancel()
        upcoming.add_done_callback(lambda task: task.cancelled() or task.exception())


def validate(options: AccuracyOptions) -> None:
    """Raise ValueError naming the option to fix."""
    if options.length <= 0:
        raise ValueError(f"--length must be positive, got {options.length}")
    if not 0 < options.min_recovery <= 1.5:
        raise ValueError(f"--min-recovery must be in (0, 1.5], got {options.min_recovery}")
    if not 0 < options.confidence < 1:
        raise ValueError(f"--confidence must be between 0 and 1, got {options.confidence}")
    if options.max_samples < 1 or options.min_samples < 1:
        raise ValueError("--max-samples and --min-samples must be at least 1")
    if not 0 <= options.baseline_floor < 1:
        raise ValueError(f"--baseline-floor must be in [0, 1), got {options.baseline_floor}")
    if not 1 <= options.asked <= options.needles:
        raise ValueError(f"--asked must be between 1 and --needles ({options.needles}), got {options.asked}")
    if not 1 <= options.length_buckets <= MAX_PROFILE_BUCKETS:
        raise ValueError(f"--length-buckets must be between 1 and {MAX_PROFILE_BUCKETS}, got {options.length_buckets}")
    if options.length >> (options.length_buckets - 1) < 1:
        raise ValueError(f"--length-buckets {options.length_buckets} halves --length {options.length} below one token")
    if options.task == AccuracyTask.MRCR and options.prompt_format == PromptFormat.COMPLETION:
        raise ValueError("--task mrcr is a conversation: give --prompt-format Chat or Auto")
    if options.mrcr_needles not in (2, 4, 8):
        raise ValueError(f"--mrcr-needles must be 2, 4 or 8, got {options.mrcr_needles}")
    if options.request_timeout_seconds <= 0:
        raise ValueError(f"--request-timeout-seconds must be positive, got {options.request_timeout_seconds}")


async def run_accuracy_gate(
    options: AccuracyOptions,
    credentials: CredentialsSource | None = None,
    on_progress: Callable[[AccuracyProgress], None] = lambda _: None,
) -> dict[str, Any]:
    """The gate's JSON result; never raises for endpoint or credential trouble (that is an Inconclusive result)."""
    try:
        opened = credentials.open() if credentials is not None else None
    except CredentialsError as error:
        return _result(options, "Inconclusive", GateReason.CREDENTIALS_UNREADABLE, str(error))
    async with open_session(opened) as session:

        def client(url: str) -> VllmClient:
            return VllmClient(
                session, url, options.model, options.request_timeout_seconds, options.retry_delays_s, opened
            )

        try:
            # The baseline is production: its prompts keep the policy's pace (pacing.py).
            baseline = paced(client(options.baseline), options.baseline_requests_per_minute)
            return await _evaluate(options, client(options.canary), baseline, on_progress)
        except GateError as error:
            return _result(options, "Inconclusive", error.reason, str(error))
