"""`kvpolicy gate accuracy|latency`: run a gate, print its JSON result; exit 0 pass, 1 fail/breach, 2 inconclusive."""

from __future__ import annotations

import argparse
import asyncio

from kvpolicy.gates import report
from kvpolicy.gates.accuracy import AccuracyOptions, run_accuracy_gate
from kvpolicy.gates.accuracy import validate as validate_accuracy
from kvpolicy.gates.latency import LatencyOptions, run_latency_probe
from kvpolicy.gates.latency import validate as validate_latency


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpolicy gate", description=__doc__)
    gates = parser.add_subparsers(dest="gate", required=True)

    accuracy = gates.add_parser("accuracy", help="long-context needle retrieval: canary vs baseline")
    _endpoints(accuracy)
    accuracy.add_argument("--length", type=int, required=True, help="prompt length in tokens")
    accuracy.add_argument("--min-recovery", type=float, default=0.95, help="canary/baseline score needed to pass")
    accuracy.add_argument("--confidence", type=float, default=0.95, help="credible level of the recovery interval")
    accuracy.add_argument("--max-samples", type=int, default=100, help="hard cap on prompts")
    accuracy.add_argument("--min-samples", type=int, default=3, help="prompts before the gate may stop early")
    accuracy.add_argument("--seed", type=int, default=0, help="selects the prompts")

    latency = gates.add_parser("latency", help="TTFT and ITL fits at concurrency 1: canary vs baseline")
    _endpoints(latency)
    latency.add_argument("--lengths", type=int, nargs="+", required=True, help="input lengths to probe (>= 3)")
    latency.add_argument("--requests-per-length", type=int, default=3)
    latency.add_argument("--output-tokens", type=int, default=128)
    latency.add_argument("--workload-lengths", type=int, nargs="+", default=[], help="lengths to compare at")
    latency.add_argument("--ttft-max-ratio", type=float, default=1.25, help="largest canary/baseline TTFT allowed")
    latency.add_argument("--itl-max-ratio", type=float, default=1.05, help="largest canary/baseline ITL allowed")
    latency.add_argument(
        "--time-scale", type=float, default=1.0, help="the servers' time scale: measured times are divided by it"
    )
    return parser


def _endpoints(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--canary", required=True, help="canary base URL, e.g. http://10.0.0.5:8000")
    parser.add_argument("--baseline", required=True, help="baseline base URL")
    parser.add_argument("--model", required=True, help="served model name on both endpoints")
    parser.add_argument("--timeout-seconds", type=float, default=600.0, help="per-request timeout")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.gate == "accuracy":
            accuracy = AccuracyOptions(
                canary=args.canary,
                baseline=args.baseline,
                length=args.length,
                model=args.model,
                min_recovery=args.min_recovery,
                confidence=args.confidence,
                max_samples=args.max_samples,
                min_samples=args.min_samples,
                seed=args.seed,
                timeout_s=args.timeout_seconds,
            )
            validate_accuracy(accuracy)
            return report.emit(asyncio.run(run_accuracy_gate(accuracy)))
        latency = LatencyOptions(
            canary=args.canary,
            baseline=args.baseline,
            lengths=tuple(args.lengths),
            model=args.model,
            requests_per_length=args.requests_per_length,
            output_tokens=args.output_tokens,
            workload_lengths=tuple(args.workload_lengths),
            ttft_max_ratio=args.ttft_max_ratio,
            itl_max_ratio=args.itl_max_ratio,
            time_scale=args.time_scale,
            timeout_s=args.timeout_seconds,
        )
        validate_latency(latency)
        return report.emit(asyncio.run(run_latency_probe(latency)))
    except ValueError as error:
        parser.error(str(error))
