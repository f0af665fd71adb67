"""A vLLM-like server for tests, benchmarks and the demo (`kvpolicy sim`).

Start one in this event loop with `serve(SimConfig(...))`, or as a child process with
`start_simulator_subprocess([...flags...])`; both give the base URL.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

from kvpolicy_dev.sim.config import Gpu, SimConfig
from kvpolicy_dev.sim.server import Simulator, serve

__all__ = ["Gpu", "SimConfig", "Simulator", "free_port", "serve", "start_simulator_subprocess", "wait_healthy"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url`/health until it answers 200; raise RuntimeError on timeout or if `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"simulator exited with code {process.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"simulator at {url} did not become healthy within {timeout_s} s")


@contextlib.contextmanager
def start_simulator_subprocess(
    args: Sequence[str], host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 30.0
) -> Iterator[str]:
    """Run `python -m kvpolicy sim ARGS --host HOST --port PORT` until the block exits; yields its base URL.

    The child's stderr goes to a temporary file (never a pipe nobody drains) and is quoted if it fails to start.
    """
    port = port or free_port(host)
    command = [sys.executable, "-m", "kvpolicy", "sim", *args, "--host", host, "--port", str(port)]
    url = f"http://{host}:{port}"
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=dict(os.environ))
        try:
            try:
                wait_healthy(url, timeout_s, process)
            except RuntimeError as error:
                stderr.seek(0)
                raise RuntimeError(f"{error}:\n{stderr.read().decode(errors='replace')}") from None
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
