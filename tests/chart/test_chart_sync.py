"""The chart's copies of repository files are identical to their sources, and every version number agrees."""

from __future__ import annotations

import tomllib

import kvpolicy
import pytest
import yaml
from chart_helpers import CHART_DIR, REPO_ROOT
from dockerfile_parse import DockerfileParser

# chart copy -> source (Helm reads only files inside the chart).
COPIES = {
    "crds/kvpolicy.yaml": "crds/kvpolicy.yaml",
    "files/alerts.yaml": "monitoring/alerts.yaml",
    "files/dashboard.json": "monitoring/dashboard.json",
}


@pytest.mark.parametrize(("copy", "source"), COPIES.items())
def test_chart_copy_is_identical_to_its_source(copy: str, source: str) -> None:
    copied = (CHART_DIR / copy).read_bytes()
    original = (REPO_ROOT / source).read_bytes()
    assert copied == original, f"{copy} differs from {source}: cp {source} charts/kvpolicy-operator/{copy}"


def package_version() -> str:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    version: str = pyproject["project"]["version"]
    return version


def test_chart_version_and_app_version_follow_the_package() -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert package_version() == kvpolicy.__version__
    assert chart["version"] == package_version()
    assert chart["appVersion"] == package_version()


def test_probe_image_tag_names_the_kernels_build() -> None:
    """The default probe image is the one kernels/Dockerfile builds: v<vLLM base tag>-kv<package version>."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    vllm_base_image = DockerfileParser(str(REPO_ROOT / "kernels" / "Dockerfile")).baseimage
    vllm_tag = vllm_base_image.rsplit(":", 1)[1]
    assert values["probeImage"]["tag"] == f"{vllm_tag}-kv{package_version()}"
