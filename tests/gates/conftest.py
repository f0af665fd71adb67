"""Session simulators: child processes on free loopback ports, started once."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from gate_fakes import FAST, MAX_MODEL_LEN, MODEL
from kvpolicy_dev.sim import start_simulator_subprocess
from kvpolicy_dev.sim.tokenizer_zoo import Family, write_model_dir


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


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Family, Path]:
    """A Hugging Face model directory per tokenizer family (tiny Llama config.json + tokenizer files)."""
    root = tmp_path_factory.mktemp("models")
    return {family: write_model_dir(family, root / family.value, MAX_MODEL_LEN) for family in Family}
