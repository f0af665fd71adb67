"""The latency probe: `vllm bench serve`-style streaming requests at concurrency 1 against canary and baseline.

For each side it fits ITL = slope·L + intercept and TTFT = a·L² + b·L + c over the probed input lengths, then reports
the decode break-even length and both ratios (canary / baseline) at the workload's lengths. A ratio above its limit
at any workload length is a Breach.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpolicy.api.reasons import GateReason
from kvpolicy.api.v1alpha1 import LatencyGate, parse_decimal
from kvpolicy.credentials import CredentialsError, CredentialsSource
from kvpolicy.gate_programs.client import RETRY_DELAYS_S, GateError, VllmClient, open_session
from kvpolicy.gate_programs.niah import FILLER

# The CRD's ratio limits are the probe's defaults: one source.
CRD_DEFAULTS = LatencyGate()


@dataclass(frozen=True)
class LatencyOptions:
    canary: str
    baseline: str
    lengths: tuple[int, ...]
    model: str
    requests_per_length: int = 3
    output_tokens: int = 128
    workload_lengths: tuple[int, ...] = ()
    ttft_max_ratio: float = parse_decimal(CRD_DEFAULTS.ttft_max_ratio)
    itl_max_ratio: float = parse_decimal(CRD_DEFAULTS.itl_max_ratio)
    time_scale: float = 1.0
    request_timeout_seconds: float = 600.0
    retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S
    # Load matching (`match_load`): the canary's pods, and how many reads of a baseline pod's running requests.
    match_load: bool = True
    canary_pods: int = 1
    load_reads: int = 5
    load_read_spacing_s: float = 0.2


@dataclass(frozen=True)
class LatencyProgress:
    """One measured request (for a person watching `kvpolicy gate`)."""

    side: str
    measurement: Measurement
    done: int
    total: int


@dataclass(frozen=True)
class Fit:
    itl_slope_ms_per_token: float
    itl_intercept_ms: float
    ttft_quad_ms_per_token2: float
    ttft_linear_ms_per_token: float
    ttft_const_ms: float

    def itl_ms(self, length: float) -> float:
        return self.itl_slope_ms_per_token * length + self.itl_intercept_ms

    def ttft_ms(self, length: float) -> float:
        return self.ttft_quad_ms_per_token2 * length**2 + self.ttft_linear_ms_per_token * length + self.ttft_const_ms

    def as_json(self) -> dict[str, float]:
        return {
            "itlSlopeMsPerToken": self.itl_slope_ms_per_token,
            "itlInterceptMs": self.itl_intercept_ms,
            "ttftQuadMsPerToken2": self.ttft_quad_ms_per_token2,
            "ttftLinearMsPerToken": self.ttft_linear_ms_per_token,
            "ttftConstMs": self.ttft_const_ms,
        }


@dataclass(frozen=True)
class Measurement:
    length: int
    ttft_ms: float
    itl_ms: float


def fit_measurements(measurements: list[Measurement]) -> Fit:
    """Least-squares fits through the per-length medians (one stalled request does not bend the curve)."""
    lengths = sorted({m.length for m in measurements})
    ttft = [float(np.median([m.ttft_ms for m in measurements if m.length == length])) for length in lengths]
    itl = [float(np.median([m.itl_ms for m in measurements if m.length == length])) for length in lengths]
    itl_slope, itl_intercept = np.polyfit(lengths, itl, 1)
    quad, linear, const = np.polyfit(lengths, ttft, 2)
    return Fit(float(itl_slope), float(itl_intercept), float(quad), float(linear), float(const))


def break_even_tokens(canary: Fit, baseline: Fit) -> int | None:
    """Context length from which the canary decodes faster (None: its ITL slope is not smaller, so never)."""
    slope_gain = baseline.itl_slope_ms_per_token - canary.itl_slope_ms_per_token
    if slope_gain <= 0:
        return None
    return max(0, round((canary.itl_intercept_ms - baseline.itl_intercept_ms) / slope_gain))


def validate(options: LatencyOptions) -> None:
    if len(set(options.lengths)) < 3:
        raise ValueError(f"--lengths needs at least 3 distinct lengths for the TTFT fit, got {list(options.lengths)}")
    if min(options.lengths) < 1 or (options.workload_lengths and min(options.workload_lengths) < 1):
        raise ValueError("--lengths and --workload-lengths must be positive")
    if options.requests_per_length < 1 or options.output_tokens < 2:
        raise ValueError("--requests-per-length must be >= 1 and --output-tokens >= 2 (ITL needs two tokens)")
    if options.canary_pods < 1:
        raise ValueError(f"--canary-pods must be at least 1, got {options.canary_pods}")
    if options.time_scale <= 0 or options.request_timeout_seconds <= 0:
        raise ValueError("--time-scale and --request-timeout-seconds must be positive")


async def _filler_ids(client: VllmClient) -> list[int]:
    ids = await client.tokenize(" " + FILLER, add_special_tokens=False)
    if not ids:
        raise GateError(GateReason.MALFORMED_RESPONSE, f"{client.base_url} tokenized the filler to nothing")
    return ids


async def _prepare(client: VllmClient, options: LatencyOptions) -> list[int]:
    """Check the lengths fit the endpoint and return its filler token ids."""
    limit = await client.max_model_len()
    longest = max(options.lengths)
    if longest + options.output_tokens > limit:
        raise GateError(
            GateReason.LENGTH_EXCEEDS_MAX_MODEL_LEN,
            f"{client.base_url} serves at most {limit} tokens; {longest} input plus {options.output_tokens} output "
            "tokens do not fit (lower --lengths or --output-tokens)",
        )
    return await _filler_ids(client)


LEAD_TOKENS = 3


def probe_prompt(filler: list[int], length: int, serial: int) -> list[int]:
    """`length` tokens of repeated filler behind a lead of LEAD_TOKENS ids that differs for each `serial` (the
    filler's distinct ids counted in base N): prompts share no first cache block, so none reuses another's prefill."""
    digits = sorted(set(filler))
    lead = []
    for _ in range(LEAD_TOKENS):
        serial, digit = divmod(serial, len(digits))
        lead.append(digits[digit])
    repeats = -(-length // len(filler))
    return (lead + filler * repeats)[:length]


async def _measure(
    clients: list[VllmClient], options: LatencyOptions, on_progress: Callable[[LatencyProgress], None]
) -> tuple[list[list[Measurement]], LoadMatch]:
    """One request at a time, alternating between the endpoints so both see the same conditions (and neither
    client's work delays the other's token timestamps), with the canary loaded as a baseline pod is (`match_load`).
    Every prompt starts differently (`probe_prompt`), so no prefix cache can help: not the previous length's prompt,
    nor the other side's when both share a server."""
    fillers = await asyncio.gather(*(_prepare(client, options) for client in clients))
    load = await match_load(clients[1], options)
    background = asyncio.create_task(_background(clients[0], fillers[0], options, load.canary_streams))
    try:
        return await _measure_sides(clients, fillers, options, on_progress), load
    finally:
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)


async def _measure_sides(
    clients: list[VllmClient],
    fillers: list[list[int]],
    options: LatencyOptions,
    on_progress: Callable[[LatencyProgress], None],
) -> list[list[Measurement]]:
    measurements: list[list[Measurement]] = [[] for _ in clients]
    scale = 1000 / options.time_scale
    total = len(options.lengths) * options.requests_per_length * len(clients)
    done = 0
    for length in options.lengths:
        for _ in range(options.requests_per_length):
            for side, client, filler, runs in zip(SIDES, clients, fillers, measurements, strict=True):
                timing = await client.stream_timing(probe_prompt(filler, length, done), options.output_tokens)
                runs.append(Measurement(length, timing.ttft_s * scale, timing.itl_s * scale))
                done += 1
                on_progress(LatencyProgress(side, runs[-1], done, total))
    return measurements


RUNNING_REQUESTS = frozenset({"vllm:num_requests_running", "vllm_num_requests_running"})


def running_requests(page: str) -> float | None:
    """vLLM's requests in its running batch (summed over engines) from a /metrics page; None when it has none."""
    total: float | None = None
    for line in page.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in RUNNING_REQUESTS:
            continue
        after_labels = line[line.rindex("}") + 1 :] if "}" in line else line[len(name) :]
        try:
            total = (total or 0.0) + float(after_labels.split()[0])
        except (IndexError, ValueError):
            continue
    return total


@dataclass(frozen=True)
class LoadMatch:
    """The users' load on a baseline pod while the probe measures, and the streams that put as much on the canary."""

    baseline_running: float | None  # median running requests of a baseline pod; None: not readable
    canary_streams: int
    note: str

    def as_json(self) -> dict[str, Any]:
        return {"baselineRunningPerPod": self.baseline_running, "canaryBackgroundStreams": self.canary_streams}


async def match_load(baseline: VllmClient, options: LatencyOptions) -> LoadMatch:
    """The baseline pods serve users while the probe measures them; the canary (Synthetic: no users) would be judged
    idle against loaded pods and look faster than it is. Read a baseline pod's running requests a few times (the
    Service picks a pod per connection) and keep as many streams per canary pod running during the measurement."""
    if not options.match_load:
        return LoadMatch(None, 0, "load matching off: the canary is measured idle")
    readings: list[float] = []
    for read in range(options.load_reads):
        if read:
            await asyncio.sleep(options.load_read_spacing_s)
        try:
            found = running_requests(await baseline.metrics_text())
        except GateError as error:
            unread = f"the baseline's /metrics could not be read ({error})"
            return LoadMatch(None, 0, f"{unread}: the canary is measured idle")
        if found is not None:
            readings.append(found)
    if not readings:
        missing = "the baseline's /metrics has no vllm:num_requests_running"
        return LoadMatch(None, 0, f"{missing}: the canary is measured idle")
    running = float(np.median(readings))
    streams = round(running * options.canary_pods)
    note = f"{streams} stream(s) kept on the canary, matching {running:g} running request(s) per baseline pod"
    return LoadMatch(running, streams, note)


async def _background(client: VllmClient, filler: list[int], options: LatencyOptions, streams: int) -> None:
    """`streams` requests at a time on `client`, each at the shortest workload length, until cancelled. Their own
    failures are the probe's to find: they are not raised here."""
    length = min(options.workload_lengths or options.lengths)
    # Long answers keep each stream in the running batch across many probe requests (a user's request is there for
    # its whole answer), rather than coming and going between them.
    output_tokens = options.output_tokens * BACKGROUND_OUTPUT_FACTOR

    async def stream(index: int) -> None:
        serial = BACKGROUND_SERIALS + index * BACKGROUND_SERIALS
        while True:
            serial += 1
            try:
                await client.stream_timing(probe_prompt(filler, length, serial), output_tokens)
            except GateError:
                await asyncio.sleep(options.load_read_spacing_s)

    await asyncio.gather(*(stream(index) for index in range(streams)))


# Background prompts' serials start far above the probe's (a few hundred), so no prompt shares a first cache block.
BACKGROUND_SERIALS = 100_000
BACKGROUND_OUTPUT_FACTOR = 8


def _evaluate(options: LatencyOptions, canary: Fit, baseline: Fit) -> dict[str, Any]:
    comparisons = []
    breaches = []
    for length in options.workload_lengths or options.lengths:
        ttft_ratio = canary.ttft_ms(length) / baseline.ttft_ms(length)
        itl_ratio = canary.itl_ms(length) / baseline.itl_ms(length)
        comparisons.append({"length": length, "ttftRatio": round(ttft_ratio, 4), "itlRatio": round(itl_ratio, 4)})
        if ttft_ratio > options.ttft_max_ratio:
            breaches.append(f"TTFT x{ttft_ratio:.2f} at {length} tokens (limit {options.ttft_max_ratio})")
        if itl_ratio > options.itl_max_ratio:
            breaches.append(f"ITL x{itl_ratio:.2f} at {length} tokens (limit {options.itl_max_ratio})")
    verdict, reason = (
        ("Breach", GateReason.LATENCY_ABOVE_LIMIT) if breaches else ("Pass", GateReason.LATENCY_WITHIN_LIMITS)
    )
    message = "; ".join(breaches) if breaches else "canary TTFT and ITL stay within limits at every workload length"
    return {
        "gate": "latency",
        "verdict": verdict,
        "reason": reason,
        "message": message,
        "canary": canary.as_json(),
        "baseline": baseline.as_json(),
        "breakEvenTokens": break_even_tokens(canary, baseline),
        "atWorkloadLengths": comparisons,
        "ttftMaxRatio": options.ttft_max_ratio,
        "itlMaxRatio": options.itl_max_ratio,
    }


def _inconclusive(options: LatencyOptions, reason: str, message: str) -> dict[str, Any]:
    return {
        "gate": "latency",
        "verdict": "Inconclusive",
        "reason": reason,
        "message": message,
        "canary": None,
        "baseline": None,
        "breakEvenTokens": None,
        "atWorkloadLengths": [],
        "ttftMaxRatio": options.ttft_max_ratio,
        "itlMaxRatio": options.itl_max_ratio,
    }


SIDES = ("canary", "baseline")


async def run_latency_probe(
    options: LatencyOptions,
    credentials: CredentialsSource | None = None,
    on_progress: Callable[[LatencyProgress], None] = lambda _: None,
) -> dict[str, Any]:
    """Probe both sides at concurrency 1; endpoint or credential trouble gives Inconclusive."""
    try:
        opened = credentials.open() if credentials is not None else None
    except CredentialsError as error:
        return _inconclusive(options, GateReason.CREDENTIALS_UNREADABLE, str(error))
    async with open_session(opened) as session:
        clients = [
            VllmClient(session, url, options.model, options.request_timeout_seconds, options.retry_delays_s, opened)
            for url in (options.canary, options.baseline)
        ]
        try:
            (canary_runs, baseline_runs), load = await _measure(clients, options, on_progress)
        except GateError as error:
            return _inconclusive(options, error.reason, str(error))
    result = _evaluate(options, fit_measurements(canary_runs), fit_measurements(baseline_runs))
    result["load"] = load.as_json()
    result["message"] = f"{result['message']} ({load.note})"
    return result
