"""Child processes of the demo (Prometheus, the operator): each in its own session, so stopping it stops its group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

STOP_GRACE_SECONDS = 5.0


class ChildExitedError(RuntimeError):
    """A child the demo needs ended on its own; the message names it and quotes the end of its log."""


class ChildProcess:
    """`async with ChildProcess(name, argv, log) as child:` starts argv; leaving stops its whole process group.

    Its output goes to `log`, so a failure can be explained without flooding the terminal.
    """

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self._argv = list(argv)
        self._env = None if env is None else dict(env)
        self.log = log
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    async def __aenter__(self) -> Self:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                *self._argv,
                env=self._env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.stop()

    async def stop(self, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM to the group, SIGKILL after the grace period; also reaps what the leader left behind."""
        process = self._process
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_seconds):
                    await process.wait()
            except TimeoutError:
                pass
        # The leader may be gone while children it started still run in its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()

    def log_tail(self, lines: int = 20) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def check_running(self) -> None:
        if self.returncode is not None:
            raise ChildExitedError(
                f"{self.name} exited with code {self.returncode}; the end of {self.log}:\n{self.log_tail()}"
            )
