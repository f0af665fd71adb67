"""The `kvpolicy` subcommands this distribution adds (registered under the `kvpolicy.commands` entry-point group)."""

from kvpolicy.cli import Subcommand

SIM = Subcommand("kvpolicy_dev.sim.cli", "run a vLLM-like simulator with emulated FP8 accumulation")
DEMO = Subcommand("kvpolicy_dev.demo.cli", "run the whole rollout loop on this machine")
