"""Session simulators: child processes on free loopback ports, started once."""

import contextlib
from collections.abc import Iterator

import pytest
from gate_fakes import MAX_MODEL_LEN, MODEL
from kvpolicy_dev.sim import start_simulator_subprocess

FAST = ["--time-scale", "0.001", "--max-model-len", str(MAX_MODEL_LEN)]


@pytest.fixture(scope="session")
def simulators() -> Iterator[dict[str, str]]:
    configurations = {
        "bf16": [],
        "unfixed": ["--kv-cache-dtype", "fp8"],
        "fixed": ["--kv-cache-dtype", "fp8", "--two-level-fix"],
        "b200": ["--kv-cache-dtype", "fp8", "--gpu", "b200"],
    }
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(start_simulator_subprocess([MODEL, *FAST, *flags]))
            for name, flags in configurations.items()
        }
