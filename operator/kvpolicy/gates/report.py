"""A gate's result: one JSON object on stdout, also in the pod's termination log, and an exit code."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TERMINATION_LOG_ENV = "KVPOLICY_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_LOG_LIMIT = 4096

EXIT_CODES = {"Pass": 0, "Fail": 1, "Breach": 1, "Inconclusive": 2}


def render(result: dict[str, Any]) -> str:
    """Compact JSON within the termination-log limit (Kubernetes keeps at most 4 KiB): shorten the message if needed."""
    text = json.dumps(result, separators=(",", ":"))
    overflow = len(text.encode()) - TERMINATION_LOG_LIMIT
    if overflow > 0 and isinstance(result.get("message"), str):
        message: str = result["message"]
        text = json.dumps(
            {**result, "message": message[: max(0, len(message) - overflow - 3)] + "..."}, separators=(",", ":")
        )
    return text


def termination_log_path() -> Path | None:
    configured = os.environ.get(TERMINATION_LOG_ENV)
    if configured:
        return Path(configured)
    return DEFAULT_TERMINATION_LOG if DEFAULT_TERMINATION_LOG.exists() else None


def emit(result: dict[str, Any]) -> int:
    """Print the result, write the termination log, and return the exit code for its verdict."""
    text = render(result)
    print(text, flush=True)
    path = termination_log_path()
    if path is not None:
        path.write_text(text)
    return EXIT_CODES[result["verdict"]]
