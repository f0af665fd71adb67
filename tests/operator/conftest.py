"""Fixtures of the operator's end-to-end tests: the KVPolicy CRD in the dev cluster, and the operator under kopf."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from e2e_helpers import PATCHED_IMAGE, OperatorFactory
from kopf.testing import KopfRunner
from kvpolicy.api import crd
from kvpolicy.controller import handlers
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster

OPERATOR_ENV = {
    "KVPOLICY_POLL_SECONDS": "0.2",
    "KVPOLICY_IDLE_SECONDS": "5",
    "KVPOLICY_GATE_IMAGE": "kvpolicy-operator:test",
    "KVPOLICY_PROBE_IMAGE": "vllm-kvkernels:test",
}


@pytest.fixture(scope="session")
def kvpolicy_crd(devcluster: ThreadedDevCluster) -> None:
    devcluster.apply(crd.crd_object())


@pytest.fixture
def operator(kvpolicy_crd: None, monkeypatch: pytest.MonkeyPatch) -> OperatorFactory:
    """`with operator() as runner:` runs the operator's handlers under kopf, as `kvpolicy run` does."""
    for key, value in OPERATOR_ENV.items():
        monkeypatch.setenv(key, value)

    @contextmanager
    def run() -> Iterator[KopfRunner]:
        args = ["run", "--standalone", "--all-namespaces"]
        with KopfRunner(args, registry=handlers.registry, timeout=60) as runner:
            yield runner
        assert runner.exception is None, runner.output
        assert runner.exit_code == 0, runner.output

    return run


@pytest.fixture
def fixed_image_runner(devcluster: ThreadedDevCluster) -> None:
    """Simulated vLLM pods whose FP8 attention is fixed in the patched image (they pass the accuracy gate)."""
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))
