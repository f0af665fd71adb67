"""tools/install_k8s_binaries.py: version checks and the idempotent skip (the download itself runs in `make tools`)."""

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "install_k8s_binaries.py"
spec = importlib.util.spec_from_file_location("install_k8s_binaries", TOOL)
assert spec is not None and spec.loader is not None
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def fake_binary(path: Path, output: str) -> Path:
    path.write_text(f"#!{sys.executable}\nprint({output!r})\n")
    path.chmod(0o755)
    return path


def test_version_check(tmp_path: Path) -> None:
    kubectl = fake_binary(tmp_path / "kubectl", "Client Version: v1.32.3\nKustomize Version: v5.5.0")
    assert tool.installed_version_matches(kubectl, ["version", "--client"], "Client Version: v1.32.3")
    assert not tool.installed_version_matches(kubectl, ["version", "--client"], "Client Version: v1.33.0")
    assert not tool.installed_version_matches(tmp_path / "absent", ["version"], "v1")


def test_present_binaries_of_the_right_version_are_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, (_, _, expected) in tool.BINARIES.items():
        fake_binary(tmp_path / name, expected)
    cache = tmp_path / "cache"  # stays empty: nothing is downloaded
    assert tool.main(["--dest", str(tmp_path), "--cache", str(cache)]) == 0
    assert "already installed" in capsys.readouterr().out
    assert not cache.exists()
