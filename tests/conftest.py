"""Shared fixtures: the emulated Kubernetes cluster (`devcluster`, `devcluster_namespace`), from kvpolicy_dev."""

import atexit
import os
import signal
from collections.abc import Iterator
from types import FrameType

import pytest
from kvpolicy.notify import metrics

pytest_plugins = ["kvpolicy_dev.devcluster.pytest_plugin"]


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Simulator pods run in their own sessions and outlive a test run killed by a timeout. Run the exit hooks (the
    # devcluster's kills them) and stop at once: raising SystemExit here would only fail the current test.
    atexit._run_exitfuncs()
    os._exit(128 + signum)


signal.signal(signal.SIGTERM, _stop_on_sigterm)


@pytest.fixture(autouse=True)
def _operator_metrics_leading() -> Iterator[None]:
    """The operator's metrics live in one registry per process: an operator a test ran and stopped leaves it as a
    standby's (per-policy gauges off, set_leader(False)), which must not carry into the next test."""
    yield
    metrics.OPERATOR_METRICS._acting = True
