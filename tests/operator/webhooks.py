"""Webhook receivers on loopback for the notification tests: one that answers 200, one that answers 500, one that never
answers (until the test ends). Each records what it was sent; they run in a thread of their own, so a kopf operator
in another thread and a sync test can both use them."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Obj = dict[str, Any]


@dataclass
class Received:
    path: str
    content_type: str
    body: Obj


@dataclass
class Receivers:
    url: str = ""
    received: dict[str, list[Received]] = field(default_factory=lambda: {"ok": [], "fail": [], "hang": []})
    hanging_now: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, kind: str) -> list[Received]:
        with self._lock:
            return list(self.received[kind])

    def record(self, kind: str, request: web.Request, body: Obj) -> None:
        with self._lock:
            self.received[kind].append(Received(request.path, request.headers.get("Content-Type", ""), body))


@contextmanager
def loopback_receivers() -> Iterator[Receivers]:
    receivers = Receivers()
    loop = asyncio.new_event_loop()
    released = asyncio.Event()
    started = threading.Event()
    runner_box: list[web.AppRunner] = []

    async def handle(request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        body = json.loads(await request.text())
        receivers.record(kind, request, body)
        if kind == "fail":
            return web.Response(status=500, text="receiver is broken; this text must never reach a status")
        if kind == "hang":
            receivers.hanging_now += 1
            try:
                await released.wait()
            finally:
                receivers.hanging_now -= 1
            return web.Response(status=503)
        return web.Response(status=200)

    async def start() -> None:
        app = web.Application()
        app.router.add_post("/{kind}/{token}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        receivers.url = f"http://127.0.0.1:{port}"
        runner_box.append(runner)
        started.set()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=serve, name="webhook-receivers", daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield receivers
    finally:

        async def stop() -> None:
            released.set()
            await runner_box[0].cleanup()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
