"""Helpers shared by the demo tests."""

from __future__ import annotations

import asyncio
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
