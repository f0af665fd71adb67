"""Fixtures of the operator's end-to-end tests: the KVPolicy CRD in the dev cluster, and the operator under kopf."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from e2e_helpers import OPERATOR_ENV, PATCHED_IMAGE, OperatorFactory
from kopf.testing import KopfRunner
from kvpolicy.api import crd
from kvpolicy.runtime import handlers
from kvpolicy_dev.devcluster import SimulatorRunner, ThreadedDevCluster


@pytest.fixture(scope="session")
def kvpolicy_crd(devcluster: ThreadedDevCluster) -> None:
    devcluster.apply(crd.crd_object())


@pytest.fixture
def fixed_image_runner(devcluster: ThreadedDevCluster) -> None:
    """Pods of the patched image run the simulator with the two-level FP8 accumulation fix."""
    devcluster.set_runner(SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({PATCHED_IMAGE})))


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
