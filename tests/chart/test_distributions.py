"""The operator distribution carries only what runs in the operator and its gate Jobs; the development tools
(emulated cluster, simulator, numerics emulator, demo) come from `dev/` (`kvpolicy-dev`) and nothing in the
operator imports them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

from chart_helpers import REPO_ROOT
from packaging.requirements import Requirement
from test_dockerfiles import OPERATOR_DOCKERFILE, build_wheel_from_context

PRODUCT = REPO_ROOT / "operator" / "kvpolicy"
DEV_ONLY_MODULES = {
    "kvpolicy_dev",
    "kmock",
    "looptime",
    "ml_dtypes",
    "matplotlib",
    "kubernetes",
    "hypothesis",
    "pytest",
}
# import name -> distribution name, where they differ
DISTRIBUTION_OF = {
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "kubernetes_asyncio": "kubernetes-asyncio",
}


def third_party_imports() -> dict[str, set[str]]:
    """Top-level modules the operator package imports that are neither the standard library nor itself."""
    found: dict[str, set[str]] = {}
    for path in PRODUCT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "kvpolicy":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def test_operator_package_imports_no_development_code() -> None:
    offending = {name: files for name, files in third_party_imports().items() if name in DEV_ONLY_MODULES}
    assert offending == {}


def test_wheel_holds_no_harness_and_its_dependencies_are_what_it_imports(tmp_path: Path) -> None:
    wheel = build_wheel_from_context(OPERATOR_DOCKERFILE, tmp_path)
    names = wheel.namelist()
    packages = {name.split("/")[1] for name in names if name.startswith("kvpolicy/") and name.count("/") >= 2}
    assert packages.isdisjoint({"devcluster", "sim", "demo", "numerics"}), packages
    assert not [name for name in names if name.startswith("kvpolicy_dev")]
    [metadata_name] = [name for name in names if name.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    runtime = {
        Requirement(line).name.lower().replace("_", "-")
        for line in metadata.get_all("Requires-Dist") or []
        if "extra ==" not in line
    }
    imported = {DISTRIBUTION_OF.get(name, name).replace("_", "-").lower() for name in third_party_imports()}
    assert runtime == imported, (
        f"declared but not imported: {runtime - imported}; imported but undeclared: {imported - runtime}"
    )
    assert runtime.isdisjoint({"kmock", "looptime", "ml-dtypes", "matplotlib", "kubernetes"})


BLOCK_DEVELOPMENT_CODE = """
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not in the operator image)")
sys.meta_path.insert(0, _Absent())
"""


def test_operator_commands_run_without_the_development_distribution(tmp_path: Path) -> None:
    """What the image runs (`kvpolicy run`, `gate`, `crd`, `plan`) works with every development module unimportable;
    `sim` and `demo` are then unknown commands with a hint, not tracebacks."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_DEVELOPMENT_CODE.format(blocked=sorted(DEV_ONLY_MODULES)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT / "operator")])}

    def kvpolicy(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kvpolicy", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)

    for args in (["run", "--help"], ["gate", "--help"], ["crd"], ["plan", "--help"]):
        result = kvpolicy(*args)
        assert result.returncode == 0, (args, result.stderr)
    listing = kvpolicy("--help")
    assert "sim" not in listing.stdout.split("commands:")[1] and "demo" not in listing.stdout.split("commands:")[1]
    demo = kvpolicy("demo")
    assert demo.returncode == 64  # EXIT_USAGE
    assert "development distribution" in demo.stderr and "Traceback" not in demo.stderr
