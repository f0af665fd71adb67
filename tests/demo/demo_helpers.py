"""Helpers shared by the demo tests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], within: float, poll: float = 0.05) -> None:
    """Wait until `condition()` holds; TimeoutError after `within` seconds."""
    async with asyncio.timeout(within):
        while True:
            if condition():
                return
            await asyncio.sleep(poll)


def process_alive(pid: int) -> bool:
    """Whether a process runs (a zombie, exited but not yet reaped, runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_mentioning(marker: str) -> list[int]:
    """PIDs (other than this one) whose command line or environment mentions `marker`, such as a report folder."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not process_alive(int(entry)):
            continue
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{name}", "rb") as source:
                    if marker.encode() in source.read():
                        found.append(int(entry))
                        break
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found
