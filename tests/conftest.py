"""Shared fixtures: the emulated Kubernetes cluster (`devcluster`, `devcluster_namespace`), from kvpolicy_dev."""

import atexit
import os
import signal
from types import FrameType

pytest_plugins = ["kvpolicy_dev.devcluster.pytest_plugin"]


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Simulator pods run in their own sessions and outlive a test run killed by a timeout. Run the exit hooks (the
    # devcluster's kills them) and stop at once: raising SystemExit here would only fail the current test.
    atexit._run_exitfuncs()
    os._exit(128 + signum)


signal.signal(signal.SIGTERM, _stop_on_sigterm)
