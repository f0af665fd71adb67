"""A bounded number of policy passes in flight, urgent ones first.

When thousands of loops start together (a restart, a new leader after a takeover) most of their policies are at rest
(decided, their spec unchanged since): their first pass only checks for drift. A rollout in flight, a new policy or an
edited one needs its pass now. A plain semaphore serves them in the order they came, so with 5,000 policies a rollout
waiting for its promotion could wait behind 4,999 drift checks (issue 28 item 5). Waiters for an urgent slot go first;
within each kind, first come first served.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class PassSlots:
    def __init__(self, size: int) -> None:
        self._free = size
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._at_rest: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(not waiter.done() for waiter in (*self._urgent, *self._at_rest))

    @asynccontextmanager
    async def slot(self, urgent: bool) -> AsyncIterator[None]:
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, urgent: bool) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._urgent if urgent else self._at_rest
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot just as it was cancelled: pass it on
            elif waiter in queue:
                queue.remove(waiter)
            raise

    def _release(self) -> None:
        """Hand the slot to the first urgent waiter, else the first at rest, else keep it free."""
        for queue in (self._urgent, self._at_rest):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self._free += 1
