"""The `kvpolicy` command: one subcommand per tool, each owned by its own module.

Subcommand modules are imported lazily so `kvpolicy crd` does not pay for numpy or kopf. The operator's own commands
are listed here; development tools (`sim`, `demo`) come from the `kvpolicy-dev` distribution, which registers them
under the `kvpolicy.commands` entry-point group, so the operator image carries none of their code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

from kvpolicy.api.exit_codes import EXIT_OK, EXIT_USAGE

COMMAND_ENTRY_POINTS = "kvpolicy.commands"
DEV_ONLY = frozenset({"sim", "demo"})


@dataclass(frozen=True)
class Subcommand:
    module: str  # exposes `main(argv: list[str]) -> int`
    help: str


SUBCOMMANDS: dict[str, Subcommand] = {
    "run": Subcommand("kvpolicy.runtime.run", "run the operator (kopf)"),
    "crd": Subcommand("kvpolicy.api.crd", "print the KVPolicy CustomResourceDefinition"),
    "plan": Subcommand("kvpolicy.planning.cli", "dry-run the planner for a KVPolicy on a GPU"),
    "gate": Subcommand("kvpolicy.gate_programs.cli", "run a gate: accuracy (long-context NIAH) or latency (probe)"),
}


def installed_subcommands() -> dict[str, Subcommand]:
    """The operator's commands plus the `Subcommand`s other installed distributions register."""
    commands = dict(SUBCOMMANDS)
    for entry in entry_points(group=COMMAND_ENTRY_POINTS):
        if entry.name in commands:
            continue
        try:
            command = entry.load()
        except ImportError:  # registered by a distribution whose code is gone: not a command of this install
            continue
        if isinstance(command, Subcommand):
            commands[entry.name] = command
    return commands


def _usage(commands: dict[str, Subcommand]) -> str:
    lines = ["usage: kvpolicy <command> [options]", "", "commands:"]
    lines += [f"  {name:<6} {command.help}" for name, command in commands.items()]
    lines += ["", "Run `kvpolicy <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = installed_subcommands()
    if not args or args[0] in ("-h", "--help"):
        print(_usage(commands))
        return EXIT_OK if args else EXIT_USAGE
    if args[0] in ("-V", "--version"):
        from kvpolicy import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in commands:
        hint = " (it comes with the development distribution: pip install ./dev)" if name in DEV_ONLY else ""
        print(f"kvpolicy: unknown command {name!r}{hint}\n\n{_usage(commands)}", file=sys.stderr)
        return EXIT_USAGE
    module = importlib.import_module(commands[name].module)
    result: int = module.main(rest)
    return result
