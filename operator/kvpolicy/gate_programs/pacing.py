"""Pacing the requests a gate sends to the production pods behind the baseline Service (the policy's
gates.accuracy.baselineRequestsPerMinute).

The accuracy gate sends every prompt to both sides, at the workload's full length; the baseline side is production. A
`Pacer` spaces those requests evenly (no burst: a sample's questions, sent together, leave one per interval), and
`PacedClient` is a vLLM client whose completions wait for it. The canary is not paced: it serves no users yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kvpolicy.gate_programs.client import Completion, VllmClient


class Pacer:
    """At most `per_minute` starts a minute, evenly spaced; `clock` and `sleep` are injectable for tests."""

    def __init__(
        self,
        per_minute: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if per_minute < 1:
            raise ValueError(f"--baseline-requests-per-minute must be at least 1, got {per_minute}")
        self.spacing = 60.0 / per_minute
        self._clock = clock
        self._sleep = sleep
        self._next: float | None = None

    async def wait(self) -> None:
        """Return at this request's turn. Turns are handed out at call time, so concurrent callers queue in order."""
        now = self._clock()
        turn = now if self._next is None else max(now, self._next)
        self._next = turn + self.spacing
        if turn > now:
            await self._sleep(turn - now)


class PacedClient(VllmClient):
    """A vLLM client whose completions (the prompts the gate sends) keep the pacer's rate; tokenizing is not paced
    (it is short and runs on the API server's CPU, not the GPU)."""

    def __init__(self, client: VllmClient, pacer: Pacer) -> None:
        self.__dict__.update(client.__dict__)
        self.pacer = pacer

    async def complete(self, prompt: str | list[int], max_tokens: int) -> Completion:
        await self.pacer.wait()
        return await super().complete(prompt, max_tokens)


def paced(client: VllmClient, per_minute: int | None) -> VllmClient:
    """`client` itself when no rate is set."""
    return client if per_minute is None else PacedClient(client, Pacer(per_minute))
