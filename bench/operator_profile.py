"""Run `kvpolicy run` with profilers, for bench/operator_scale.py --profile DIR (issue 28 item 4).

    python bench/operator_profile.py DIR [kvpolicy run arguments...]

- cProfile in every thread (kopf runs in one of its own): DIR/cpu-<thread>.prof when the thread ends (SIGTERM).
- tracemalloc (KVPOLICY_TRACEMALLOC_FRAMES frames, default 1; 0: off): on each SIGUSR1 a snapshot DIR/mem-<n>.snap
  and a line in DIR/mem.txt with the traced total beside the RSS, and the top lines by file and line.
"""

from __future__ import annotations

import cProfile
import os
import re
import signal
import sys
import threading
import tracemalloc
from pathlib import Path
from types import FrameType
from typing import Any


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def profiled(target: Any, name: str, out: Path) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        profile = cProfile.Profile()
        profile.enable()
        try:
            return target(*args, **kwargs)
        finally:
            profile.disable()
            profile.dump_stats(out / f"cpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.prof")

    return run


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    frames = int(os.environ.get("KVPOLICY_TRACEMALLOC_FRAMES", "1"))
    if frames:
        tracemalloc.start(frames)
    taken = [0]

    def snapshot(signum: int, frame: FrameType | None) -> None:
        taken[0] += 1
        with (out / "mem.txt").open("a") as log:
            if not frames:
                print(f"{taken[0]}: RSS {rss_mib():.1f} MiB", file=log)
                return
            shot = tracemalloc.take_snapshot()
            shot.dump(str(out / f"mem-{taken[0]}.snap"))
            traced, peak = tracemalloc.get_traced_memory()
            summary = f"RSS {rss_mib():.1f} MiB, traced {traced / 2**20:.1f} (peak {peak / 2**20:.1f})"
            print(f"{taken[0]}: {summary}", file=log)
            for stat in shot.statistics("lineno")[:25]:
                print(f"    {stat.size / 2**20:8.2f} MiB {stat.count:9d}  {stat.traceback[0]}", file=log)

    signal.signal(signal.SIGUSR1, snapshot)
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        profiled(original, self.name, out)(self)

    threading.Thread.run = run  # type: ignore[method-assign]
    from kvpolicy.runtime.run import main as kvpolicy_run

    return profiled(kvpolicy_run, "main", out)(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
