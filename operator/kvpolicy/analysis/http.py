"""The HTTP client both providers share: one aiohttp session per provider, opened on first use."""

from __future__ import annotations

from types import TracebackType
from typing import Self

import aiohttp


class HttpClient:
    """Owns a lazily created aiohttp session with a total timeout per request; use `async with` or `close()`."""

    def __init__(self, timeout_seconds: float, what: str) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"{what} timeout must be above 0 seconds, got {timeout_seconds!r}")
        self.timeout_seconds = timeout_seconds
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_seconds))
        return self._session
