"""Shared helpers of the Helm chart and Dockerfile tests: paths, the tools they run, and manifest lookups.

A module of its own (not conftest.py) because several test folders have a conftest and `import conftest` would be
ambiguous.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "kvpolicy-operator"
CUSTOM_VALUES = Path(__file__).resolve().parent / "values-custom.yaml"
HA_VALUES = Path(__file__).resolve().parent / "values-ha.yaml"
RELEASE = "kvp"
RELEASE_NAMESPACE = "kvpolicy-system"

Manifest = dict[str, Any]
Triple = tuple[str, str, str]  # an RBAC permission: (API group, resource[/subresource], verb)
Renderer = Callable[..., list[Manifest]]


class RenderError(Exception):
    pass


def find_tool(name: str) -> Path:
    """The executable from the virtual environment (where `make test` installs it) or PATH.

    Missing on CI is a failure: `make test` must have installed it. Missing locally skips.
    """
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    message = f"{name} not found in {beside_python.parent} or PATH (make tools / make test installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def run_tool(args: Sequence[str | Path], cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(arg) for arg in args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


# No kvpolicy image is published, so the chart requires the registry they were pushed to.
REGISTRY = "registry.example.com/kvpolicy"
# The user-facing ClusterRoles (kvpolicy-view, kvpolicy-edit) are labelled for aggregation; the operator's are not.
AGGREGATE_LABEL = "rbac.authorization.k8s.io/aggregate-to-admin"


def operator_rbac(manifests: list[Manifest]) -> list[Manifest]:
    """The manifests without the aggregated user-facing ClusterRoles: the operator's own RBAC and the rest."""
    return [m for m in manifests if AGGREGATE_LABEL not in (m.get("metadata", {}).get("labels") or {})]


def operator_cluster_role(manifests: list[Manifest]) -> Manifest:
    """The ClusterRole the operator's ServiceAccount is bound to."""
    return only(operator_rbac(manifests), "ClusterRole")


def only(manifests: list[Manifest], kind: str) -> Manifest:
    """The single manifest of a kind (fails when there are none or several)."""
    matching = of_kind(manifests, kind)
    assert len(matching) == 1, f"expected one {kind}, rendered {len(matching)}"
    return matching[0]


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [manifest for manifest in manifests if manifest["kind"] == kind]


def operator_container(manifests: list[Manifest]) -> dict[str, Any]:
    containers = only(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [container["name"] for container in containers] == ["operator"]
    container: dict[str, Any] = containers[0]
    return container


def granted(role: Manifest) -> set[Triple]:
    """Every permission a Role or ClusterRole grants."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
