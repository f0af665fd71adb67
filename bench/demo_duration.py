"""How long `kvpolicy demo` takes, run after run, and whether it leaves anything behind.

    .venv/bin/python bench/demo_duration.py [--runs 2] [--fast]

Each run is a fresh `kvpolicy demo` process with its own report folder; the script times the decision table and the
whole run, and after each run looks through /proc for any process still mentioning that folder.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def leftovers(marker: str) -> list[int]:
    """Processes whose command line or environment mention `marker`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        for name in ("cmdline", "environ"):
            try:
                if marker.encode() in Path(f"/proc/{entry}/{name}").read_bytes():
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return found


def run_once(report_dir: Path, fast: bool) -> tuple[float, float, int, list[int]]:
    argv = [sys.executable, "-m", "kvpolicy", "demo", "--report-dir", str(report_dir), *(["--fast"] if fast else [])]
    start = time.monotonic()
    decided_at = float("nan")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if line.rstrip().endswith("decisions:"):
                decided_at = time.monotonic() - start
    total = time.monotonic() - start
    return decided_at, total, process.returncode, leftovers(str(report_dir))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load {load:.1f}")
    print("| run | decisions s | total s | exit | processes left |\n|---|---|---|---|---|")
    failed = False
    with tempfile.TemporaryDirectory(prefix="demo-bench-") as tmp:
        for run in range(1, args.runs + 1):
            decided, total, code, left = run_once(Path(tmp) / f"run{run}", args.fast)
            print(f"| {run} | {decided:.1f} | {total:.1f} | {code} | {len(left)} |", flush=True)
            failed |= code != 0 or bool(left)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
