"""`kvpolicy run` as a process: what stays up for the life of the pod, around kopf.

- /healthz (the chart's liveness and readiness probes) and /metrics are served here, so that a standby replica and an
  operator riding out an API outage still answer them.
- The API server's health: `GET /readyz` every few seconds. `kvpolicy_api_reachable` and /healthz's body say whether
  it answers; one log line when an outage begins, one when it ends. When it ends, the policies' loops waiting out an
  API failure look again at once instead of at the end of their backoff.
- kopf runs in a thread of its own, on its own event loop: kopf cancels every task of its loop when it stops, and a
  stop must not take the probe, the elector or the servers with it. kopf is started when this replica leads (at once
  without leader election), stopped as soon as the Lease is lost (its writes are fenced before that: leader.py), and
  started again, with backoff, when it fails. kopf's own requests retry API errors without end (handlers.startup).

Probes: /healthz answers 200 during an API outage and on a standby, its body saying what is degraded. A restart
cannot bring the API server back, and failing readiness on every replica at once would only block node drains through
the PodDisruptionBudget. It answers 503 only when kopf's event loop stops answering: a wedged operator, which a
restart does fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException

from kvpolicy.api.reasons import RequestReason
from kvpolicy.kube.leader import KubernetesLeaseStore, LeaderElection, LeaderElector
from kvpolicy.kube.login import ClusterLogin
from kvpolicy.notify import metrics
from kvpolicy.runtime import handlers

logger = logging.getLogger(__name__)

PROBE_INTERVAL_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 5.0
# Below the chart's probe timeout (5 s): a kopf loop that cannot run a no-op in this long is wedged.
KOPF_PING_SECONDS = 2.0
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# A kopf run this long counts as healthy: its failure starts the backoff from its beginning again.
HEALTHY_RUN_SECONDS = 300.0


# ------------------------------------------------------------------------------------------------------ API health


@dataclass
class ApiHealth:
    """Whether the API server answered the latest probe, and since when it has not."""

    reachable: bool | None = None  # None until the first probe
    failing_since: float | None = None  # time.monotonic() of the first failed probe of the current outage
    last_error: str | None = None

    def record(self, error: str | None, now: float) -> bool:
        """Keep a probe's outcome; True when it changes reachability (an outage began or ended)."""
        changed = self.reachable != (error is None)
        self.reachable = error is None
        self.last_error = error
        if error is None:
            self.failing_since = None
        elif self.failing_since is None:
            self.failing_since = now
        return changed

    def report(self, now: float) -> dict[str, Any]:
        report: dict[str, Any] = {"reachable": self.reachable}
        if self.failing_since is not None:
            report["unreachableSeconds"] = round(now - self.failing_since)
            report["lastError"] = self.last_error
        return report


def probe_failure(error: BaseException) -> str:
    """A short reason for a failed probe: the HTTP status code, else the kind of failure."""
    if isinstance(error, ApiException):
        return str(error.status)
    if isinstance(error, TimeoutError):
        return RequestReason.TIMEOUT
    if isinstance(error, aiohttp.ClientError | OSError):
        return RequestReason.CONNECTION_ERROR
    return type(error).__name__


class ApiProbe:
    """GET /readyz (kube-apiserver's own readiness: etcd included, readable by every user) every few seconds."""

    def __init__(
        self,
        client: ApiClient,
        health: ApiHealth,
        on_recovery: Callable[[], None] = lambda: None,
        interval_seconds: float = PROBE_INTERVAL_SECONDS,
        login: ClusterLogin | None = None,
    ) -> None:
        self.client = client
        self.login = login
        self.health = health
        self.on_recovery = on_recovery
        self.interval_seconds = interval_seconds

    async def check(self) -> str | None:
        """None when the API server is ready, else why not."""

        async def readyz() -> object:
            return await self.client.call_api(
                "/readyz",
                "GET",
                auth_settings=["BearerToken"],
                response_types_map={200: "str"},
                _return_http_data_only=True,
                _request_timeout=PROBE_TIMEOUT_SECONDS,
            )

        try:
            async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
                await (readyz() if self.login is None else self.login.once_more_after_401(readyz))
        except Exception as error:
            return probe_failure(error)
        return None

    async def run(self) -> None:
        while True:
            error = await self.check()
            now = time.monotonic()
            started = self.health.failing_since
            if self.health.record(error, now):
                if error is not None:
                    logger.warning("the API server does not answer (%s): riding it out, retrying", error)
                elif started is not None:
                    logger.info("the API server answers again after %.0f s", now - started)
                    self.on_recovery()
            metrics.set_api_reachable(error is None, error)
            await asyncio.sleep(self.interval_seconds)


# ------------------------------------------------------------------------------------------------------------ kopf


class KopfRun:
    """One run of kopf in a thread of its own (see the module doc), stopped through its stop flag."""

    def __init__(self, operator: Callable[[threading.Event], Coroutine[Any, Any, None]]) -> None:
        self._operator = operator
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.kopf_loop: asyncio.AbstractEventLoop | None = None
        self.started_at = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        self._thread = threading.Thread(target=self._main, name="kopf", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        async def operate() -> None:
            self.kopf_loop = asyncio.get_running_loop()
            await self._operator(self.stop_flag)

        try:
            asyncio.run(operate())
        except BaseException as error:  # handed to the supervisor, which logs it and starts kopf again
            self.error = error
        finally:
            self.kopf_loop = None
            self._loop.call_soon_threadsafe(self._done.set)

    async def ended(self) -> None:
        await self._done.wait()

    async def stop(self) -> None:
        self.stop_flag.set()
        await self._done.wait()
        await asyncio.to_thread(self._thread.join)

    def call_soon(self, function: Callable[[], None]) -> None:
        """Run `function` on kopf's loop (objects in kopf's memo live there)."""
        loop = self.kopf_loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(function)

    async def answers(self) -> bool:
        """Whether kopf's loop runs a no-op within KOPF_PING_SECONDS (False once it has ended)."""
        loop = self.kopf_loop
        if loop is None:
            return False
        try:
            future = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop)
            async with asyncio.timeout(KOPF_PING_SECONDS):
                await asyncio.wrap_future(future)
        except (TimeoutError, RuntimeError):
            return False
        return True


async def _first(*waits: Awaitable[Any]) -> None:
    """Return when the first of `waits` is done; cancel the others."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _next_term(elector: LeaderElector) -> None:
    """Until this replica leads again. The fence closes at the renew deadline, a moment before the elector's loop
    notices: wait for it to stand by first, or its old term would count as the next one."""
    await elector.wait_until_standby()
    await elector.wait_until_leading()


# ------------------------------------------------------------------------------------------------------ supervisor


@dataclass(frozen=True)
class RunSettings:
    """What `kvpolicy run` was asked for."""

    clusterwide: bool
    namespaces: tuple[str, ...]
    options: handlers.OperatorOptions
    liveness_address: str = "0.0.0.0"
    liveness_port: int | None = None  # None: no /healthz
    election: LeaderElection | None = None
    login: ClusterLogin | None = None  # the credentials `kvpolicy run` found, shared with kopf and the API client


@dataclass
class Supervisor:
    settings: RunSettings
    configuration: Configuration
    health: ApiHealth = field(default_factory=ApiHealth)
    restarts: int = 0
    last_failure: str | None = None
    _kopf: KopfRun | None = None
    _memo: kopf.Memo | None = None
    _elector: LeaderElector | None = None

    @property
    def role(self) -> str:
        if self._elector is None:
            return "single"
        return "leader" if self._elector.is_leader() else "standby"

    # ----------------------------------------------------------------------------------------------- /healthz

    async def health_report(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /healthz: see the module doc for when it is not 200."""
        kopf_run = self._kopf
        running = kopf_run is not None and kopf_run.kopf_loop is not None
        wedged = running and kopf_run is not None and not await kopf_run.answers()
        acting = self.role != "standby"
        degraded = self.health.reachable is False or (acting and not running)
        report: dict[str, Any] = {
            "status": "wedged" if wedged else "degraded" if degraded else "ok",
            "api": self.health.report(time.monotonic()),
            "operator": {"role": self.role, "running": running, "restarts": self.restarts},
        }
        if self.last_failure:
            report["operator"]["lastFailure"] = self.last_failure
        election = self.settings.election
        if election is not None and self._elector is not None:
            report["leaderElection"] = {
                "lease": f"{election.namespace}/{election.lease}",
                "identity": election.identity,
                "holder": self._elector.holder,
            }
        return (503 if wedged else 200), report

    async def _serve_health(self, request: web.Request) -> web.Response:
        status, report = await self.health_report()
        return web.json_response(report, status=status)

    async def _start_servers(self) -> list[web.AppRunner]:
        runners = []
        options = self.settings.options
        if self.settings.liveness_port is not None:
            app = web.Application()
            app.router.add_get("/healthz", self._serve_health)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, self.settings.liveness_address, self.settings.liveness_port).start()
            runners.append(runner)
        if options.metrics_port is not None:
            runners.append(await metrics.start_metrics_server(options.metrics_address, options.metrics_port))
            logger.info("metrics on %s:%d/metrics", options.metrics_address, options.metrics_port)
        return runners

    # ---------------------------------------------------------------------------------------------------- kopf

    def _wake_backing_off_policies(self) -> None:
        memo, kopf_run = self._memo, self._kopf
        if memo is not None and kopf_run is not None and "reconciler" in memo:
            kopf_run.call_soon(memo["reconciler"].wake_backing_off)

    def _start_kopf(self) -> KopfRun:
        fence = self._elector.is_leader if self._elector is not None else None
        memo = kopf.Memo(options=self.settings.options, fence=fence, login=self.settings.login)

        async def operator(stop_flag: threading.Event) -> None:
            await kopf.operator(
                registry=handlers.registry,
                standalone=True,
                clusterwide=self.settings.clusterwide,
                namespaces=self.settings.namespaces,
                memo=memo,
                stop_flag=stop_flag,
            )

        self._memo = memo
        kopf_run = KopfRun(operator)
        kopf_run.start()
        return kopf_run

    async def _run_kopf(self, stop: asyncio.Event) -> bool:
        """Run kopf until asked to stop, until this replica loses the Lease, or until kopf ends by itself (a
        failure); True in that last case."""
        kopf_run = self._kopf = self._start_kopf()
        metrics.set_leader(True)
        waits: list[Awaitable[Any]] = [kopf_run.ended(), stop.wait()]
        if self._elector is not None:
            waits.append(self._elector.wait_until_standby())
        try:
            await _first(*waits)
        finally:
            metrics.set_leader(False)
            await kopf_run.stop()
            self._kopf = self._memo = None
        if stop.is_set() or (self._elector is not None and not self._elector.is_leader()):
            return False
        self.last_failure = repr(kopf_run.error) if kopf_run.error else "kopf ended without an error"
        logger.error("the operator's kopf engine stopped: %s", self.last_failure, exc_info=kopf_run.error)
        return True

    async def supervise(self, stop: asyncio.Event) -> None:
        """Run kopf while this replica may act, and again after it fails (with backoff), until `stop`."""
        failures = 0
        while not stop.is_set():
            elector = self._elector
            if elector is not None and not elector.is_leader():
                await _first(_next_term(elector), stop.wait())
                continue
            started = time.monotonic()
            if not await self._run_kopf(stop):
                continue
            failures = 1 if time.monotonic() - started >= HEALTHY_RUN_SECONDS else failures + 1
            self.restarts += 1
            metrics.record_operator_restart()
            delay = RESTART_BACKOFF_SECONDS[min(failures, len(RESTART_BACKOFF_SECONDS)) - 1]
            logger.warning("starting the operator's kopf engine again in %.0f s (restart %d)", delay, self.restarts)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    # ---------------------------------------------------------------------------------------------------- main

    async def serve(self) -> None:
        """Until SIGTERM or SIGINT: then stop kopf, give the Lease up, and return."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        runners = await self._start_servers()
        background: list[asyncio.Task[None]] = []
        try:
            async with ApiClient(self.configuration) as client:
                probe = ApiProbe(
                    client, self.health, on_recovery=self._wake_backing_off_policies, login=self.settings.login
                )
                background.append(asyncio.create_task(probe.run(), name="API probe"))
                election = self.settings.election
                if election is not None:
                    store = KubernetesLeaseStore(client, election.namespace, election.lease, self.settings.login)
                    # time.monotonic, not the loop's clock: kopf's thread asks the fence too.
                    self._elector = LeaderElector(store, election.identity, election.timing, clock=time.monotonic)
                    background.append(asyncio.create_task(self._elector.run(), name="leader election"))
                    logger.info(
                        "leader election on Lease %s/%s as %s", election.namespace, election.lease, election.identity
                    )
                try:
                    await self.supervise(stop)
                finally:
                    for task in background:
                        task.cancel()
                    await asyncio.gather(*background, return_exceptions=True)
                    if self._elector is not None:
                        await self._elector.release()
        finally:
            for runner in runners:
                await runner.cleanup()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
