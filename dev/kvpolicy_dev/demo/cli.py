"""`kvpolicy demo`: the whole FP8 KV-cache rollout loop on this machine, with a decision table and a report.

Exit status: 0 when every policy was decided, 1 when the demo could not finish (the message says why), 130 after
Ctrl-C and 143 after SIGTERM (everything it started is stopped first).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

from kvpolicy_dev.demo.processes import ChildExitedError
from kvpolicy_dev.demo.run import DemoError, DemoOptions, KeepOpen, Servers, run_demo
from kvpolicy_dev.demo.scenarios import DEMO_TIMING, FAST_TIMING, VLLM_TIMING

DEMO_DEADLINE_SECONDS = 150.0
FAST_DEADLINE_SECONDS = 120.0
# Per wave of scenarios: starting real vLLM pods (target, canary, promoted target) takes minutes on two cores.
VLLM_DEADLINE_SECONDS = 900.0
SIM_REQUESTS_PER_SECOND = 3.0
VLLM_REQUESTS_PER_SECOND = 1.0
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpolicy demo",
        description="Run an emulated cluster with simulated GPU pools, the operator and six KVPolicies; show their "
        "decisions and write a report.",
    )
    parser.add_argument(
        "--report-dir", type=Path, help="where to write the report (default: ./demo-report-<UTC timestamp>)"
    )
    parser.add_argument("--fast", action="store_true", help="shorter gates and bake (for tests)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the report, leave the cluster, the operator and the pods running (the kubeconfig is printed) to "
        "try kubectl and `kubectl kvpolicy` on the decided policies; Ctrl-C stops everything",
    )
    parser.add_argument(
        "--no-prometheus", action="store_true", help="let the operator scrape the pods even if Prometheus is installed"
    )
    parser.add_argument(
        "--deadline-seconds", type=float, help="give up waiting for decisions after this long (default: 150, fast 120)"
    )
    parser.add_argument(
        "--requests-per-second",
        type=float,
        help=f"user requests per second to each model Service (default {SIM_REQUESTS_PER_SECOND:g}; "
        f"{VLLM_REQUESTS_PER_SECOND:g} with --servers vllm)",
    )
    parser.add_argument(
        "--servers",
        choices=[servers.value for servers in Servers],
        default=Servers.SIMULATOR.value,
        help="what the model pods run: the simulator (default), or real vLLM (its CPU build with a tiny random-weight "
        "model; accuracy gates still answered by the simulator's FP8 emulation; scenarios run two at a time; minutes)",
    )
    return parser


def options_from_args(args: argparse.Namespace, now: datetime) -> DemoOptions:
    default_dir = Path(f"demo-report-{now.strftime('%Y%m%d-%H%M%S')}")
    servers = Servers(args.servers)
    real = servers == Servers.VLLM
    deadline = args.deadline_seconds
    if deadline is None:
        deadline = VLLM_DEADLINE_SECONDS if real else FAST_DEADLINE_SECONDS if args.fast else DEMO_DEADLINE_SECONDS
    rate = args.requests_per_second
    if rate is None:
        rate = VLLM_REQUESTS_PER_SECOND if real else SIM_REQUESTS_PER_SECOND
    if deadline <= 0 or rate <= 0:
        raise ValueError("--deadline-seconds and --requests-per-second must be above 0")
    if real and args.fast:
        raise ValueError("--fast is for the simulator: real vLLM pods take about a minute to start whatever the timing")
    timing = VLLM_TIMING if real else FAST_TIMING if args.fast else DEMO_TIMING
    return DemoOptions(
        report_dir=(args.report_dir or default_dir).resolve(),
        timing=timing,
        mode="real vLLM mode" if real else "fast mode" if args.fast else "demo mode",
        use_prometheus=not args.no_prometheus,
        deadline_seconds=deadline,
        requests_per_second=rate,
        servers=servers,
        keep=args.keep,
    )


STOP_MESSAGES = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
EXIT_CODES = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}


async def _run_until_signalled(options: DemoOptions) -> int:
    """Run the demo; the first Ctrl-C or SIGTERM cancels it and the cleanup runs to the end, whatever follows."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    received: list[signal.Signals] = []
    keep = KeepOpen() if options.keep else None

    def on_signal(signum: signal.Signals) -> None:
        # Only the first signal acts: a second Ctrl-C must not cut the cleanup short and orphan processes.
        if not received:
            if keep is not None and keep.waiting.is_set():
                keep.release.set()  # the expected way out of --keep: the demo finishes as it would have
            else:
                main.cancel()
        received.append(signum)

    for signum in STOP_MESSAGES:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        live = sys.stdout.isatty()
        # One column short: a line filling the last column wraps on some terminals and breaks the redraw.
        width = shutil.get_terminal_size().columns - 1 if live else None
        result = await run_demo(options, sys.stdout, live=live, width=width, keep=keep)
    except asyncio.CancelledError:
        if not received:
            raise
        print(f"\nkvpolicy demo: {STOP_MESSAGES[received[0]]}; everything it started is stopped", file=sys.stderr)
        return EXIT_CODES[received[0]]
    finally:
        for signum in STOP_MESSAGES:
            loop.remove_signal_handler(signum)
            if received:  # stopping anyway: a late Ctrl-C must not turn a clean exit into a traceback
                signal.signal(signum, signal.SIG_IGN)
    return 0 if result.decided else 1


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args, datetime.now(UTC))
    except ValueError as error:
        parser.error(str(error))
    try:
        return asyncio.run(_run_until_signalled(options))
    except (DemoError, ChildExitedError) as error:
        print(f"kvpolicy demo: {error}", file=sys.stderr)
        return 1
