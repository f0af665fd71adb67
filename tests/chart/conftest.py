"""Fixtures for the Helm chart and Dockerfile tests: helm, and the chart rendered once per value set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART_DIR,
    CUSTOM_VALUES,
    HA_VALUES,
    REGISTRY,
    RELEASE,
    RELEASE_NAMESPACE,
    Manifest,
    Renderer,
    RenderError,
    find_tool,
    run_tool,
)


@pytest.fixture(scope="session")
def helm() -> Path:
    return find_tool("helm")


@pytest.fixture(scope="session")
def render(helm: Path) -> Renderer:
    """`helm template` the chart (CRDs included) and parse the manifests; raises with helm's message on failure."""

    def _render(*extra_args: str | Path, chart: Path = CHART_DIR) -> list[Manifest]:
        template = [helm, "template", RELEASE, chart, "--namespace", RELEASE_NAMESPACE, "--include-crds"]
        template += ["--set", f"imageRegistry={REGISTRY}"]
        result = run_tool([*template, *extra_args])
        if result.returncode != 0:
            raise RenderError(result.stderr)
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return _render


@pytest.fixture(scope="session")
def default_manifests(render: Renderer) -> list[Manifest]:
    return render()


@pytest.fixture(scope="session")
def custom_manifests(render: Renderer) -> list[Manifest]:
    return render("--values", CUSTOM_VALUES)


@pytest.fixture(scope="session")
def ha_manifests(render: Renderer) -> list[Manifest]:
    return render("--values", HA_VALUES)


@pytest.fixture(scope="session")
def custom_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(CUSTOM_VALUES.read_text())
    return values
