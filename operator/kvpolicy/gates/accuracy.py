"""The long-context accuracy gate: does the canary keep the baseline's needle-retrieval score at N tokens?

Canary and baseline answer the same seeded RULER-style prompts, each sized to exactly N tokens with the server's own
tokenizer. After every prompt the recovery interval (kvpolicy.gates.stats) is checked: once it lies entirely above
min_recovery the gate passes, entirely below it fails; at the sample cap it is inconclusive. An endpoint that keeps
failing makes the result inconclusive, never a pass.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpolicy.gates import niah
from kvpolicy.gates.client import EndpointUnavailable, RequestRejected, VllmClient
from kvpolicy.gates.report import GateError
from kvpolicy.gates.stats import PairedCounts, RecoveryInterval, recovery_interval

ANSWER_TOKENS = 64
SIZING_ATTEMPTS = 8


@dataclass(frozen=True)
class AccuracyOptions:
    canary: str
    baseline: str
    length: int
    model: str
    min_recovery: float = 0.95
    confidence: float = 0.95
    max_samples: int = 100
    min_samples: int = 3
    seed: int = 0
    timeout_s: float = 600.0
    needles: int = 8
    asked: int = 4
    retry_delays_s: tuple[float, ...] = (0.2, 0.5, 1.0)


async def sized_prompt(client: VllmClient, sample: niah.NiahSample, length: int) -> str:
    """Render `sample` with as much haystack as makes exactly `length` tokens by the server's tokenizer."""
    bare = len(await client.tokenize(niah.render(sample, 0)))
    if bare >= length:
        raise GateError(
            "LengthTooShort", f"length {length} leaves no room for haystack: the needles alone take {bare} tokens"
        )
    filler = length - bare
    for _ in range(SIZING_ATTEMPTS):
        prompt = niah.render(sample, filler)
        tokens = len(await client.tokenize(prompt))
        if tokens == length:
            return prompt
        filler = max(0, filler + length - tokens)
    raise GateError(
        "PromptSizing", f"could not size a prompt to exactly {length} tokens with {client.base_url}'s tokenizer"
    )


def _result(
    options: AccuracyOptions,
    verdict: str,
    reason: str,
    message: str,
    samples: int = 0,
    counts: PairedCounts | None = None,
    interval: RecoveryInterval | None = None,
) -> dict[str, Any]:
    def number(value: float | None) -> float | None:
        return None if value is None or math.isnan(value) else round(value, 4)

    return {
        "gate": "accuracy",
        "verdict": verdict,
        "reason": reason,
        "message": message,
        "lengthTokens": options.length,
        "samples": samples,
        "canaryScore": number(counts.canary_score) if counts else None,
        "baselineScore": number(counts.baseline_score) if counts else None,
        "recovery": number(interval.point) if interval else None,
        "recoveryLow": number(interval.low) if interval else None,
        "recoveryHigh": number(interval.high) if interval else None,
        "minRecovery": options.min_recovery,
        "confidence": options.confidence,
    }


def sequential_decision(interval: RecoveryInterval, samples: int, options: AccuracyOptions) -> tuple[str, str] | None:
    """(verdict, reason) once the interval lies clearly on one side of min_recovery, else None (keep sampling)."""
    if samples < options.min_samples:
        return None
    if interval.low > options.min_recovery:
        return "Pass", "RecoveryAboveThreshold"
    if interval.high < options.min_recovery:
        return "Fail", "RecoveryBelowThreshold"
    return None


async def _check_endpoints(canary: VllmClient, baseline: VllmClient, length: int) -> None:
    limits = await asyncio.gather(canary.max_model_len(), baseline.max_model_len())
    for client, limit in zip((canary, baseline), limits, strict=True):
        if length + ANSWER_TOKENS > limit:
            raise GateError(
                "LengthExceedsMaxModelLen",
                f"{client.base_url} serves at most {limit} tokens; a {length}-token prompt plus {ANSWER_TOKENS} "
                f"answer tokens does not fit (lower --length or raise --max-model-len)",
            )


async def _evaluate(options: AccuracyOptions, canary: VllmClient, baseline: VllmClient) -> dict[str, Any]:
    await _check_endpoints(canary, baseline, options.length)

    async def prepare(index: int) -> tuple[niah.NiahSample, str]:
        sample = niah.draw_sample(options.seed, index, options.needles, options.asked)
        return sample, await sized_prompt(baseline, sample, options.length)

    counts = PairedCounts()
    interval = recovery_interval(counts, options.confidence)
    # The next prompt is sized while both servers answer the current one.
    upcoming = asyncio.create_task(prepare(0))
    try:
        for index in range(options.max_samples):
            sample, prompt = await upcoming
            if index + 1 < options.max_samples:
                upcoming = asyncio.create_task(prepare(index + 1))
            if index == 0 and len(await canary.tokenize(prompt)) != options.length:
                raise GateError(
                    "TokenizerMismatch", "canary and baseline tokenize the same prompt to different lengths"
                )
            canary_text, baseline_text = await asyncio.gather(
                canary.complete(prompt, ANSWER_TOKENS), baseline.complete(prompt, ANSWER_TOKENS)
            )
            for canary_right, baseline_right in zip(
                niah.matches_per_needle(canary_text, sample.expected),
                niah.matches_per_needle(baseline_text, sample.expected),
                strict=True,
            ):
                counts = counts.add(canary_right, baseline_right)
            interval = recovery_interval(counts, options.confidence)
            samples = index + 1
            decision = sequential_decision(interval, samples, options)
            if decision is not None:
                verdict, reason = decision
                point = "n/a" if interval.point is None else f"{interval.point:.3f}"
                side = "above" if verdict == "Pass" else "below"
                message = (
                    f"recovery {point} (interval {interval.low:.3f}-{interval.high:.3f}) after {samples} prompts "
                    f"lies {side} {options.min_recovery}"
                )
                return _result(options, verdict, reason, message, samples, counts, interval)
    finally:
        # A prompt sized ahead but not needed: stop it, and mark any error it ended with as retrieved.
        upcoming.cancel()
        upcoming.add_done_callback(lambda task: task.cancelled() or task.exception())
    message = (
        f"after {options.max_samples} prompts the recovery interval {interval.low:.3f}-{interval.high:.3f} "
        f"still contains {options.min_recovery}"
    )
    return _result(options, "Inconclusive", "SampleCapReached", message, options.max_samples, counts, interval)


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
    if options.timeout_s <= 0:
        raise ValueError(f"--timeout-seconds must be positive, got {options.timeout_s}")


async def run_accuracy_gate(options: AccuracyOptions) -> dict[str, Any]:
    """The gate's JSON result; never raises for endpoint trouble (that is an Inconclusive result)."""
    async with aiohttp.ClientSession() as session:
        canary = VllmClient(session, options.canary, options.model, options.timeout_s, options.retry_delays_s)
        baseline = VllmClient(session, options.baseline, options.model, options.timeout_s, options.retry_delays_s)
        try:
            return await _evaluate(options, canary, baseline)
        except GateError as error:
            return _result(options, "Inconclusive", error.reason, str(error))
        except EndpointUnavailable as error:
            return _result(options, "Inconclusive", "EndpointUnavailable", str(error))
        except RequestRejected as error:
            return _result(options, "Inconclusive", "RequestRejected", str(error))
