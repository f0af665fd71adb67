"""`kvpolicy gate accuracy|latency`: run a gate against two vLLM servers and print its JSON result on stdout.

Exit codes: 0 pass, 1 fail (accuracy) or breach (latency), 2 inconclusive, 64 usage error (a bad flag or URL).
Progress (prompts so far and the running recovery interval; each latency request) goes to stderr, so stdout holds
only the one JSON result. Defaults are the KVPolicy CRD's. Credentials are read from files or environment variables
named by the flags, never given as values on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import fields
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpolicy.api.exit_codes import UsageParser
from kvpolicy.api.v1alpha1 import AccuracyGate, LatencyGate
from kvpolicy.credentials import CredentialsSource, SecretValue, TlsSource
from kvpolicy.gate_programs import report
from kvpolicy.gate_programs.accuracy import AccuracyOptions, AccuracyProgress, run_accuracy_gate
from kvpolicy.gate_programs.accuracy import validate as validate_accuracy
from kvpolicy.gate_programs.client import RETRY_DELAYS_S, base_url
from kvpolicy.gate_programs.latency import LatencyOptions, LatencyProgress, run_latency_probe
from kvpolicy.gate_programs.latency import validate as validate_latency

# The flags whose values a KVPolicy carries too, checked by the CRD's own models and rules (what `kubectl apply` would
# refuse is refused here, with the same words): the gate a Job runs and the one run by hand judge alike.
CRD_FLAGS: dict[str, tuple[type[BaseModel], dict[str, str]]] = {
    "accuracy": (
        AccuracyGate,
        {
            "--min-recovery": "minRecovery",
            "--confidence": "confidence",
            "--max-samples": "maxSamples",
            "--baseline-floor": "baselineFloor",
            "--baseline-requests-per-minute": "baselineRequestsPerMinute",
        },
    ),
    "latency": (LatencyGate, {"--ttft-max-ratio": "ttftMaxRatio", "--itl-max-ratio": "itlMaxRatio"}),
}


def check_against_crd(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first flag whose value the KVPolicy CRD refuses."""
    model, flags = CRD_FLAGS[args.gate]
    for flag, field in flags.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:  # an optional flag left out (the field's default is unset too)
            continue
        # The CRD's ratios are decimal strings: 1e-05 is written 0.00001, NaN and inf stay what they are.
        given = value if isinstance(value, int) else format(Decimal(str(value)), "f")
        try:
            model.model_validate({field: given})
        except ValidationError as error:
            problem = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in error.errors())
            raise ValueError(f"{flag} {value}: a KVPolicy refuses it ({problem})") from None


def _with_defaults(parser: argparse.ArgumentParser, options: type[Any]) -> Callable[[str, type, str], None]:
    """Adds `--flag-name` options whose defaults are the options dataclass's `flag_name` field (the CRD's)."""
    defaults = {field.name: field.default for field in fields(options)}

    def option(flag: str, kind: type, help_text: str) -> None:
        default = defaults[flag[2:].replace("-", "_")]
        parser.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: %(default)s)")

    return option


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="kvpolicy gate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    gates = parser.add_subparsers(dest="gate", required=True, metavar="{accuracy,latency}")
    accuracy = gates.add_parser("accuracy", help="long-context needle retrieval: canary vs baseline")
    _endpoints(accuracy)
    accuracy.add_argument("--length", type=int, required=True, help="prompt length in tokens")
    option = _with_defaults(accuracy, AccuracyOptions)
    option("--min-recovery", float, "canary/baseline score needed to pass")
    option("--confidence", float, "credible level of the recovery interval")
    option("--max-samples", int, "hard cap on prompts")
    option("--min-samples", int, "prompts before the gate may stop early")
    option("--baseline-floor", float, "baseline score below which the gate cannot judge (inconclusive)")
    choice = _choices(accuracy)
    choice(
        "--task",
        AccuracyOptions.task,
        "multikey: each asked needle in its own request over the shared haystack; multiquery: all in one question; "
        "niah_*: RULER's tasks; mrcr: MRCR-format conversations, chat only (gates.accuracy.task)",
    )
    choice(
        "--prompt-format",
        AccuracyOptions.prompt_format,
        "Completion: token ids to /v1/completions; Chat: messages to /v1/chat/completions through the model's chat "
        "template; Auto: Chat when the served model has one (gates.accuracy.promptFormat)",
    )
    option("--mrcr-needles", int, "mrcr: identical asks in each conversation, 2, 4 or 8")
    option("--needles", int, "needles hidden in each prompt (multikey, multiquery)")
    option("--asked", int, "needles asked about in each prompt (multikey, multiquery)")
    option("--seed", int, "selects the prompts")
    option("--baseline-requests-per-minute", int, "most prompts a minute to the baseline (production), evenly spaced")
    option(
        "--length-buckets",
        int,
        "length profile: also sample --length halved N-1 times (4: /8, /4, /2), beside the decision at --length",
    )
    _common(accuracy, _with_defaults(accuracy, AccuracyOptions))

    latency = gates.add_parser("latency", help="TTFT and ITL fits at concurrency 1: canary vs baseline")
    _endpoints(latency)
    latency.add_argument("--lengths", type=int, nargs="+", required=True, help="input lengths to probe (>= 3)")
    latency.add_argument(
        "--workload-lengths", type=int, nargs="+", default=[], help="lengths to compare at (default: --lengths)"
    )
    option = _with_defaults(latency, LatencyOptions)
    option("--requests-per-length", int, "requests per length and side")
    option("--output-tokens", int, "tokens generated per request")
    option("--ttft-max-ratio", float, "largest canary/baseline TTFT allowed")
    option("--itl-max-ratio", float, "largest canary/baseline ITL allowed")
    option("--time-scale", float, "the servers' time scale: measured times are divided by it")
    option("--canary-pods", int, "the canary's serving pods: load matching keeps this many times a baseline pod's load")
    latency.add_argument(
        "--no-match-load",
        dest="match_load",
        action="store_false",
        help="measure the canary idle (by default it carries as many requests as a baseline pod serves its users)",
    )
    _common(latency, option)
    return parser


def _choices(parser: argparse.ArgumentParser) -> Callable[[str, StrEnum, str], None]:
    """Adds `--flag` options taking one value of the default's enum."""

    def choice(flag: str, default: StrEnum, help_text: str) -> None:
        kind = type(default)
        parser.add_argument(
            flag, type=kind, choices=list(kind), default=default, help=f"{help_text} (default: %(default)s)"
        )

    return choice


def _endpoints(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--canary", required=True, help="canary URL: http(s)://host[:port][/v1]")
    parser.add_argument("--baseline", required=True, help="baseline URL: http(s)://host[:port][/v1]")
    parser.add_argument("--model", required=True, help="served model name on both endpoints")


def _common(parser: argparse.ArgumentParser, option: Callable[[str, type, str], None]) -> None:
    parser.set_defaults(gate_parser=parser)
    option("--request-timeout-seconds", float, "timeout of each request")
    parser.add_argument(
        "--retry-delays-seconds",
        type=float,
        nargs="*",
        default=list(RETRY_DELAYS_S),
        metavar="S",
        help="seconds to wait before each retry of a request that failed in a way that may pass (connection, "
        "timeout, 5xx); none: no retries (default: %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    auth = parser.add_argument_group("credentials (values are read from files or the environment, never flags)")
    key = auth.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", type=Path, metavar="PATH", help="file holding the servers' API key")
    key.add_argument("--api-key-env", metavar="NAME", help="environment variable holding the servers' API key")
    key.add_argument(
        "--credentials-dir",
        type=Path,
        metavar="DIR",
        help="a mounted Secret: `token` (the API key), `ca.crt`, `tls.crt` and `tls.key` (https)",
    )
    auth.add_argument("--insecure-skip-verify", action="store_true", help="do not verify the servers' TLS certificates")


def retry_delays(args: argparse.Namespace) -> tuple[float, ...]:
    delays = tuple(args.retry_delays_seconds)
    if any(not delay >= 0 for delay in delays):
        raise ValueError(f"--retry-delays-seconds must be zero or more seconds each, got {list(delays)}")
    return delays


def credentials_from_args(args: argparse.Namespace) -> CredentialsSource | None:
    """Where the credentials the flags name are; None when there are none."""
    if args.credentials_dir is not None:
        return CredentialsSource.from_secret_dir(args.credentials_dir, insecure_skip_verify=args.insecure_skip_verify)
    token = None
    if args.api_key_file is not None:
        token = SecretValue(file=args.api_key_file)
    elif args.api_key_env is not None:
        token = SecretValue(env=args.api_key_env)
    if token is None and not args.insecure_skip_verify:
        return None
    return CredentialsSource(bearer_token=token, tls=TlsSource(insecure_skip_verify=args.insecure_skip_verify))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def accuracy_progress(progress: AccuracyProgress) -> str:
    counts, interval = progress.counts, progress.interval
    point = "n/a" if interval.point is None else f"{interval.point:.3f}"
    return (
        f"accuracy: {progress.samples}/{progress.options.max_samples} prompts, {counts.total} needles"
        f"{' at ' + str(progress.options.length) + ' tokens' if progress.options.length_buckets > 1 else ''}: "
        f"canary {counts.canary_score:.3f}, baseline {counts.baseline_score:.3f}, recovery {point} "
        f"(interval {interval.low:.2f}-{interval.high:.2f}; passes above {progress.options.min_recovery})"
    )


def latency_progress(progress: LatencyProgress) -> str:
    measured = progress.measurement
    return (
        f"latency: {progress.done}/{progress.total} {progress.side} at {measured.length} tokens: "
        f"TTFT {measured.ttft_ms:.1f} ms, ITL {measured.itl_ms:.2f} ms"
    )


def _reporter(quiet: bool, render: Callable[[Any], str]) -> Callable[[Any], None]:
    return (lambda _: None) if quiet else (lambda progress: _say(render(progress)))


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="kvpolicy gate: %(message)s", stream=sys.stderr)
    try:
        check_against_crd(args)
        canary, baseline = base_url(args.canary, "--canary"), base_url(args.baseline, "--baseline")
        credentials = credentials_from_args(args)
        if credentials is not None:
            credentials.open()  # a file or variable the flags name that cannot be read is a usage error
        if args.gate == "accuracy":
            accuracy = AccuracyOptions(
                canary=canary,
                baseline=baseline,
                length=args.length,
                model=args.model,
                min_recovery=args.min_recovery,
                confidence=args.confidence,
                max_samples=args.max_samples,
                min_samples=args.min_samples,
                baseline_floor=args.baseline_floor,
                task=args.task,
                prompt_format=args.prompt_format,
                mrcr_needles=args.mrcr_needles,
                needles=args.needles,
                asked=args.asked,
                seed=args.seed,
                length_buckets=args.length_buckets,
                request_timeout_seconds=args.request_timeout_seconds,
                retry_delays_s=retry_delays(args),
                baseline_requests_per_minute=args.baseline_requests_per_minute,
            )
            validate_accuracy(accuracy)
            progress = _reporter(args.quiet, accuracy_progress)
            return report.emit(asyncio.run(run_accuracy_gate(accuracy, credentials, progress)))
        latency = LatencyOptions(
            canary=canary,
            baseline=baseline,
            lengths=tuple(args.lengths),
            model=args.model,
            requests_per_length=args.requests_per_length,
            output_tokens=args.output_tokens,
            workload_lengths=tuple(args.workload_lengths),
            ttft_max_ratio=args.ttft_max_ratio,
            itl_max_ratio=args.itl_max_ratio,
            time_scale=args.time_scale,
            request_timeout_seconds=args.request_timeout_seconds,
            retry_delays_s=retry_delays(args),
            match_load=args.match_load,
            canary_pods=args.canary_pods,
        )
        validate_latency(latency)
        progress = _reporter(args.quiet, latency_progress)
        return report.emit(asyncio.run(run_latency_probe(latency, credentials, progress)))
    except ValueError as error:
        gate_parser: argparse.ArgumentParser = args.gate_parser  # its usage line shows the gate's own flags
        gate_parser.error(str(error))
