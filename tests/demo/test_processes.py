from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from kvpolicy.demo.processes import ChildExitedError, ChildProcess

# A leader that starts a grandchild deaf to SIGTERM, then waits: stopping must still leave nothing behind.
STUBBORN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running anything.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


async def test_stop_kills_the_whole_group_including_stubborn_grandchildren(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    async with ChildProcess("stubborn", [sys.executable, "-c", STUBBORN], log) as child:
        async with asyncio.timeout(10):
            while "ready" not in (log.read_text() if log.exists() else ""):
                await asyncio.sleep(0.05)
        grandchild = int(log.read_text().split()[0])
        assert os.getpgid(grandchild) == child.pid != os.getpgid(0)
        child.check_running()
        await child.stop(grace_seconds=0.5)
    assert child.returncode is not None
    async with asyncio.timeout(5):
        while _alive(grandchild):
            await asyncio.sleep(0.05)


async def test_a_child_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no cluster to talk to'); sys.exit(3)"]
    async with ChildProcess("operator", argv, tmp_path / "operator.log") as child:
        async with asyncio.timeout(10):
            while child.returncode is None:
                await asyncio.sleep(0.05)
        with pytest.raises(ChildExitedError, match=r"operator exited with code 3(.|\n)*no cluster to talk to"):
            child.check_running()


def test_pid_before_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not started"):
        _ = ChildProcess("x", ["true"], tmp_path / "x.log").pid
