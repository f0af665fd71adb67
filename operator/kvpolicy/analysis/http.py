"""The HTTP client both providers share: one aiohttp session per provider, opened on first use, with credentials."""

from __future__ import annotations

from types import TracebackType
from typing import Self

import aiohttp

from kvpolicy.analysis.model import ProviderUnavailableError
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.credentials import Credentials, CredentialsError


class HttpClient:
    """Owns a lazily created aiohttp session with a total timeout per request; use `async with` or `close()`."""

    def __init__(self, timeout_seconds: float, what: str, credentials: Credentials | None = None) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"{what} timeout must be above 0 seconds, got {timeout_seconds!r}")
        self.timeout_seconds = timeout_seconds
        self.credentials = credentials
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
            connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context) if self.credentials is not None else None
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_seconds), connector=connector
            )
        return self._session

    def _headers(self) -> dict[str, str]:
        """This request's headers; a credential that cannot be read any more makes the provider unavailable."""
        if self.credentials is None:
            return {}
        try:
            return self.credentials.headers()
        except CredentialsError as error:
            raise ProviderUnavailableError(AnalysisReason.CREDENTIALS_UNREADABLE, str(error)) from None
