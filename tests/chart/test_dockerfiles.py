"""The operator and serving-image Dockerfiles: hadolint-clean, and buildable from what their build context lets
through (no Docker engine runs here, so the build stage's package build is replayed with pip)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART_DIR, REPO_ROOT, find_tool, run_tool
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser
from kvpolicy.cli import SUBCOMMANDS

OPERATOR_DOCKERFILE = REPO_ROOT / "Dockerfile"
KERNELS_DOCKERFILE = REPO_ROOT / "kernels" / "Dockerfile"
# Dockerfile -> the build context it is documented to be built with.
BUILD_CONTEXTS = {OPERATOR_DOCKERFILE: REPO_ROOT, KERNELS_DOCKERFILE: REPO_ROOT / "kernels"}


@pytest.fixture(scope="session")
def hadolint() -> Path:
    return find_tool("hadolint")


@pytest.mark.parametrize("dockerfile", BUILD_CONTEXTS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_hadolint_passes(hadolint: Path, dockerfile: Path) -> None:
    result = run_tool([hadolint, "--no-color", dockerfile])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(hadolint: Path, tmp_path: Path) -> None:
    """Guards the invocation above: findings (here an untagged base and unpinned pip installs) fail it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = run_tool([hadolint, "--no-color", bad])
    assert result.returncode != 0
    assert "DL3006" in result.stdout
    assert "DL3013" in result.stdout


def build_context(root: Path, dockerfile: Path) -> set[str]:
    """Files Docker sends for `docker build -f dockerfile root`, applying root/.dockerignore as docker-py does."""
    ignore_file = root / ".dockerignore"
    lines = ignore_file.read_text().splitlines() if ignore_file.exists() else []
    patterns = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    included = exclude_paths(str(root), patterns, dockerfile=str(dockerfile.relative_to(root)))
    return {path for path in included if (root / path).is_file()}


def copied_sources(dockerfile: Path) -> list[str]:
    """Sources of the COPY instructions that read the build context (not `--from` another stage)."""
    sources = []
    for instruction in DockerfileParser(str(dockerfile)).structure:
        if instruction["instruction"] == "COPY" and not instruction["value"].startswith("--from"):
            sources += instruction["value"].split()[:-1]
    return sources


def in_context(source: str, context: set[str]) -> bool:
    prefix = source.rstrip("/") + "/"
    return source in context or any(path.startswith(prefix) for path in context)


@pytest.mark.parametrize("dockerfile", BUILD_CONTEXTS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_every_copy_source_is_in_the_build_context(dockerfile: Path) -> None:
    context = build_context(BUILD_CONTEXTS[dockerfile], dockerfile)
    sources = copied_sources(dockerfile)
    assert sources, "no COPY from the build context"
    missing = [source for source in sources if not in_context(source, context)]
    assert missing == [], f"COPY sources missing from the build context: {missing}"


def test_operator_build_context_holds_only_the_package() -> None:
    context = build_context(REPO_ROOT, OPERATOR_DOCKERFILE)
    assert "operator/kvpolicy/__init__.py" in context
    unexpected = {
        path
        for path in context
        if path not in {"pyproject.toml", "README.md", "Dockerfile", ".dockerignore"}
        and not path.startswith("operator/kvpolicy/")
    }
    assert unexpected == set()
    assert not [path for path in context if "__pycache__" in path or ".egg-info" in path]


def build_wheel_from_context(dockerfile: Path, tmp_path: Path) -> zipfile.ZipFile:
    """Replays the build stage: copy what the context lets through, then build the package without the network."""
    root = BUILD_CONTEXTS[dockerfile]
    source = tmp_path / "context"
    for path in build_context(root, dockerfile):
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path, source / path)
    wheels = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    result = run_tool([*pip_wheel, "--wheel-dir", wheels, source], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = wheels.glob("*.whl")
    return zipfile.ZipFile(wheel)


def entry_points(wheel: zipfile.ZipFile) -> importlib.metadata.EntryPoints:
    [name] = [name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt")]
    distribution = importlib.metadata.PathDistribution(zipfile.Path(wheel, name).parent)
    return distribution.entry_points


def test_operator_image_entrypoint_is_kvpolicy_run_and_the_package_provides_it(tmp_path: Path) -> None:
    parser = DockerfileParser(str(OPERATOR_DOCKERFILE))
    [entrypoint] = [item["value"] for item in parser.structure if item["instruction"] == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == ["kvpolicy", "run"]
    wheel = build_wheel_from_context(OPERATOR_DOCKERFILE, tmp_path)
    [script] = entry_points(wheel).select(group="console_scripts", name="kvpolicy")
    assert script.value == "kvpolicy.cli:main"
    run_module = SUBCOMMANDS["run"].module.replace(".", "/") + ".py"
    assert run_module in wheel.namelist(), f"`kvpolicy run` imports {run_module}, which the image would lack"


def test_operator_image_user_is_the_numeric_non_root_user_the_chart_runs_as() -> None:
    """runAsNonRoot can only verify a numeric USER, and the chart's runAsUser must be the image's user."""
    users = [
        item["value"] for item in DockerfileParser(str(OPERATOR_DOCKERFILE)).structure if item["instruction"] == "USER"
    ]
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0
    values: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == int(gid)


def run_python_with(site: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """Python with `site` first on the import path, as if it were the image's site-packages."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, *args], cwd=site.parent, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_serving_image_smoke_check_passes_on_what_its_build_installs(tmp_path: Path) -> None:
    """Replays the final stage: install the wheel built from the kernels context, then run its smoke check
    `python -m kvkernels.probe --help`, the module the operator's GPU preflight Job runs in this image."""
    structure = DockerfileParser(str(KERNELS_DOCKERFILE)).structure
    assert [item for item in structure if "python -m kvkernels.probe --help" in item["value"]], "no probe smoke check"
    wheel = build_wheel_from_context(KERNELS_DOCKERFILE, tmp_path)
    site = tmp_path / "site"
    pip_install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", site]
    installed = run_tool([*pip_install, str(wheel.filename)])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    located = run_python_with(site, ["-c", "import kvkernels.probe; print(kvkernels.probe.__file__)"])
    assert Path(located.stdout.strip()).is_relative_to(site), located.stdout + located.stderr
    probe_help = run_python_with(site, ["-m", "kvkernels.probe", "--help"])
    assert probe_help.returncode == 0, probe_help.stderr
