from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from demo_helpers import eventually, process_alive
from kvpolicy_dev.demo.processes import ChildExitedError, ChildProcess

# A leader that starts a grandchild deaf to SIGTERM, then waits: stopping must still leave nothing behind.
STUBBORN = """
import subprocess, sys, time
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", deaf])
print(child.pid, flush=True)
time.sleep(60)
"""


async def test_stop_kills_the_whole_group_including_stubborn_grandchildren(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    async with ChildProcess("stubborn", [sys.executable, "-c", STUBBORN], log) as child:
        await eventually(lambda: "ready" in (log.read_text() if log.exists() else ""), within=10)
        grandchild = int(log.read_text().split()[0])
        assert os.getpgid(grandchild) == child.pid != os.getpgid(0)
        child.check_running()
        await child.stop(grace_seconds=0.5)
    assert child.returncode is not None
    await eventually(lambda: not process_alive(grandchild), within=5)


async def test_a_child_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no cluster to talk to'); sys.exit(3)"]
    async with ChildProcess("operator", argv, tmp_path / "operator.log") as child:
        await eventually(lambda: child.returncode is not None, within=10)
        with pytest.raises(ChildExitedError, match=r"operator exited with code 3(.|\n)*no cluster to talk to"):
            child.check_running()


def test_pid_before_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not started"):
        _ = ChildProcess("x", ["true"], tmp_path / "x.log").pid
