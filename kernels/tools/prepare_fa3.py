"""Carry vLLM's own FlashAttention-3 to a GPU machine that has torch but no vLLM, and unpack it there.

    python kernels/tools/prepare_fa3.py pack --out DIR [--wheel vllm-0.33.0-....whl]   # here (downloads the wheel)
    python kernels/tools/prepare_fa3.py unpack --packed DIR --site SITE                # there; then PYTHONPATH=SITE

`pack` takes from the pinned vLLM wheel only what `vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)`
needs: the package's `__init__.py`, `flash_attn_interface.py` and the FA3 extension `_vllm_fa3_C.abi3.so` (built on
torch's stable C ABI; gzipped for the trip, 172 MB -> ~43 MB). The rest of vLLM is replaced by a two-file stand-in:
an empty `vllm/__init__.py` and a `vllm/platforms` whose `current_platform` answers the two capability questions the
interface asks from `torch.cuda.get_device_capability()`. Measured to load and run on an H200 with torch 2.11+cu130
(shared/reference/real-vllm.md, section 2). FA2 and FA4 (cute) are left out: the interface then reports them
unavailable and FA3 is the only version it can dispatch to.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
FA3_FILES = ("__init__.py", "flash_attn_interface.py")
FA3_EXTENSION = "_vllm_fa3_C.abi3.so"
MANIFEST = "manifest.json"

PLATFORM_STAND_IN = '''"""Stand-in for vllm.platforms (kernels/tools/prepare_fa3.py): what vllm_flash_attn asks."""

import torch


class _CudaPlatform:
    @staticmethod
    def _capability() -> int:
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor

    def has_device_capability(self, capability) -> bool:
        wanted = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return self._capability() >= wanted

    def is_device_capability_family(self, family: int) -> bool:
        return self._capability() // 10 == family // 10


current_platform = _CudaPlatform()
'''


def download_wheel(directory: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", f"vllm=={VLLM_VERSION}", "-d", str(directory)],
        check=True,
    )
    wheels = sorted(directory.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip saved no vllm-{VLLM_VERSION} wheel in {directory}")
    return wheels[0]


def pack(wheel: Path | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        source = wheel if wheel is not None else download_wheel(Path(scratch))
        with zipfile.ZipFile(source) as archive:
            for name in FA3_FILES:
                (out / name).write_bytes(archive.read(f"vllm/vllm_flash_attn/{name}"))
            digest = hashlib.sha256()
            with (
                archive.open(f"vllm/vllm_flash_attn/{FA3_EXTENSION}") as extension,
                gzip.open(out / f"{FA3_EXTENSION}.gz", "wb", compresslevel=6) as packed,
            ):
                while block := extension.read(1 << 22):
                    digest.update(block)
                    packed.write(block)
    manifest = {"vllm": VLLM_VERSION, "wheel": source.name, "extension_sha256": digest.hexdigest()}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"packed FA3 from {source.name} into {out} ({sum(f.stat().st_size for f in out.iterdir()) >> 20} MiB)")


def unpack(packed: Path, site: Path) -> None:
    manifest = json.loads((packed / MANIFEST).read_text())
    package = site / "vllm" / "vllm_flash_attn"
    package.mkdir(parents=True, exist_ok=True)
    (site / "vllm" / "__init__.py").write_text(
        f'"""Stand-in: only vllm.vllm_flash_attn of vLLM {manifest["vllm"]}."""\n\n__version__ = "{manifest["vllm"]}"\n'
    )
    (site / "vllm" / "platforms").mkdir(exist_ok=True)
    (site / "vllm" / "platforms" / "__init__.py").write_text(PLATFORM_STAND_IN)
    for name in FA3_FILES:
        shutil.copyfile(packed / name, package / name)
    digest = hashlib.sha256()
    with gzip.open(packed / f"{FA3_EXTENSION}.gz", "rb") as source, (package / FA3_EXTENSION).open("wb") as target:
        while block := source.read(1 << 22):
            digest.update(block)
            target.write(block)
    if digest.hexdigest() != manifest["extension_sha256"]:
        raise SystemExit(f"{FA3_EXTENSION} does not match the manifest's sha256: the packed copy is damaged")
    print(f"vllm.vllm_flash_attn (FA3 from vLLM {manifest['vllm']}) unpacked under {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pack_args = commands.add_parser("pack", help="extract FA3 from the pinned vLLM wheel")
    pack_args.add_argument("--out", type=Path, required=True)
    pack_args.add_argument("--wheel", type=Path, help=f"a vllm-{VLLM_VERSION} wheel (default: pip download it)")
    unpack_args = commands.add_parser("unpack", help="install the packed files as an importable vllm stand-in")
    unpack_args.add_argument("--packed", type=Path, required=True)
    unpack_args.add_argument("--site", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.wheel, args.out)
    else:
        unpack(args.packed, args.site)


if __name__ == "__main__":
    main()
