"""The exit codes every kvpolicy command keeps (`kvpolicy plan`, `kvpolicy gate`, `kubectl kvpolicy`), so that a CI
step or a script reads them alike. README "Exit codes" has the table; tests/api/test_exit_codes.py checks each
command against it.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_OK = 0  # done: a plan printed, a gate passed, a rollout Promoted or HeldBF16
# What was asked went against: a gate failed (accuracy) or breached (latency), a rollout RolledBack, a plugin command
# the policy or the API server refused (not found, nothing to approve, forbidden).
EXIT_FAILED = 1
EXIT_INCONCLUSIVE = 2  # no verdict: a gate that could not judge, `status --timeout` over before a decision
EXIT_USAGE = 64  # EX_USAGE (sysexits.h): a bad flag or value, an input file that is unreadable or invalid
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: no usable kubeconfig, or the API server cannot be reached


class UsageParser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error, which these commands mean as "inconclusive": exit EXIT_USAGE instead."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")
