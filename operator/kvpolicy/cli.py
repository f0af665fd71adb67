"""The `kvpolicy` command: one subcommand per tool, each owned by its own module.

Subcommand modules are imported lazily so `kvpolicy crd` does not pay for numpy or kopf.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). Each module exposes `main(argv: list[str]) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("kvpolicy.controller.run", "run the operator (kopf)"),
    "crd": ("kvpolicy.api.crd", "print the KVPolicy CustomResourceDefinition"),
    "plan": ("kvpolicy.plan_cli", "dry-run the planner for a KVPolicy on a GPU"),
    "sim": ("kvpolicy.sim.cli", "run a vLLM-like simulator with emulated FP8 accumulation"),
    "gate": ("kvpolicy.gates.cli", "run a gate: accuracy (long-context NIAH) or latency (probe)"),
    "demo": ("kvpolicy.demo.cli", "run the whole rollout loop on this machine"),
}


def _usage() -> str:
    lines = ["usage: kvpolicy <command> [options]", "", "commands:"]
    lines += [f"  {name:<6} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `kvpolicy <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from kvpolicy import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvpolicy: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result
