"""HTTPS on loopback in front of the dev cluster's HTTP API server, with a throwaway CA (auth_proxy.Pki).

The in-cluster configuration is https only and verifies the server against the service account's ca.crt, as in a
pod; this front gives the dev cluster exactly that, so the service-account login runs unmodified in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from pathlib import Path
from types import TracebackType
from typing import Self

from auth_proxy import Pki


class TlsFront:
    """`with TlsFront(upstream_port, workdir) as front:` serves https://127.0.0.1:{front.port}, trusted by
    `front.ca_path`, and forwards every connection to the HTTP server on 127.0.0.1:upstream_port."""

    def __init__(self, upstream_port: int, workdir: Path) -> None:
        self.upstream_port = upstream_port
        pki = Pki.create(workdir)
        self.ca_path = pki.ca_cert
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(pki.server_cert, pki.server_key)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-front", daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._forward, "127.0.0.1", 0, ssl=self._context)

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
        await self._server.wait_closed()

    async def _forward(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while chunk := await reader.read(65536):
                    writer.write(chunk)
                    await writer.drain()
            with contextlib.suppress(ConnectionError, ssl.SSLError, RuntimeError):
                writer.close()

        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))
