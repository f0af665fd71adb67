"""Shared set-up of the analysis tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_fleet import PROMETHEUS, Fleet
from pytest_asyncio import is_async_test

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Async fixtures here are session-loop fixtures (in-process servers); tests must run on that same loop.
    for item in items:
        if is_async_test(item) and item.path.parent == HERE:
            item.add_marker(pytest.mark.asyncio(loop_scope="session"), append=False)


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    """Fake vLLM pods with traffic already served, and a Prometheus that has scraped it all (started once)."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed: `make prometheus` installs Debian's package")
    fleet = Fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()
