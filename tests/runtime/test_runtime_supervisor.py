"""The process around kopf (runtime/supervisor.py): kopf's retries without end, the API probe, kopf restarted in its
thread after a failure, /healthz for a standby and for a wedged kopf, and loops woken when the API comes back."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sized
from datetime import UTC, datetime
from typing import Any

import kopf
import pytest
from fake_kube import FakeKubeApi
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import load_kube_config
from kvpolicy.kube.api import ApiError
from kvpolicy.kube.leader import LeaderElection, LeaderElector, LeaseConflictError, LeaseRecord
from kvpolicy.notify import metrics
from kvpolicy.runtime import supervisor
from kvpolicy.runtime.handlers import OperatorOptions, ride_out_api_outages
from kvpolicy.runtime.reconciler import Reconciler
from kvpolicy.runtime.supervisor import ApiHealth, ApiProbe, RunSettings, Supervisor
from kvpolicy_dev.devcluster import ThreadedDevCluster
from operator_helpers import CONFIG, NAMESPACE


def test_kopf_retries_api_errors_without_end() -> None:
    settings = kopf.OperatorSettings()
    assert len(list(settings.networking.error_backoffs)) == 8, "kopf's default: 9 attempts, then the watchers end"
    ride_out_api_outages(settings)
    backoffs = settings.networking.error_backoffs
    assert not isinstance(backoffs, Sized), "kopf counts attempts only for a schedule with a length"
    assert list(itertools.islice(backoffs, 12)) == [1, 1, 2, 3, 5, 8, 13, 15, 15, 15, 15, 15]
    assert list(itertools.islice(backoffs, 3)) == [1, 1, 2], "every request starts the schedule again"
    assert settings.watching.server_timeout and settings.watching.client_timeout, "a dead watch is noticed"


def test_api_health_remembers_when_an_outage_began() -> None:
    health = ApiHealth()
    assert health.record(None, now=0) and health.report(0) == {"reachable": True}
    assert health.record("503", now=10)
    assert not health.record("Timeout", now=15), "the same outage"
    assert health.report(40) == {"reachable": False, "unreachableSeconds": 30, "lastError": "Timeout"}
    assert health.record(None, now=50) and health.failing_since is None


async def test_the_probe_reads_readyz_and_says_when_the_api_comes_back(devcluster: ThreadedDevCluster) -> None:
    configuration = Configuration()
    await load_kube_config(config_file=str(devcluster.kubeconfig), client_configuration=configuration)
    recovered = []
    async with ApiClient(configuration) as client:
        probe = ApiProbe(client, ApiHealth(), on_recovery=lambda: recovered.append(True), interval_seconds=0.05)
        assert await probe.check() is None
        outage = devcluster.outage(503)
        try:
            assert await probe.check() == "503"
            running = asyncio.create_task(probe.run())
            await asyncio.sleep(0.3)
            assert probe.health.reachable is False and not recovered
            assert metrics.OPERATOR_METRICS.registry.get_sample_value("kvpolicy_api_reachable") == 0
        finally:
            devcluster.end_fault(outage)
        await asyncio.sleep(0.3)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert probe.health.reachable is True and recovered == [True]
    assert metrics.OPERATOR_METRICS.registry.get_sample_value("kvpolicy_api_reachable") == 1
    failures = metrics.OPERATOR_METRICS.registry.get_sample_value(
        "kvpolicy_api_probe_failures_total", {"reason": "503"}
    )
    assert failures is not None and failures >= 2


def settings(election: LeaderElection | None = None) -> RunSettings:
    return RunSettings(clusterwide=True, namespaces=(), options=OperatorOptions(), election=election)


def fake_kopf(monkeypatch: pytest.MonkeyPatch, runs: list[str]) -> None:
    """kopf.operator as the supervisor calls it: the first run fails, the next one runs until stopped."""

    async def operator(stop_flag: threading.Event, **_: Any) -> None:
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            raise RuntimeError("a watcher failed")
        await asyncio.to_thread(stop_flag.wait)

    monkeypatch.setattr(supervisor.kopf, "operator", operator)


async def kopf_started(boss: Supervisor, runs: int = 1, given: list[str] | None = None) -> None:
    """Wait until kopf's loop runs in its thread (for the `runs`-th time, counting `given`)."""
    for _ in range(200):
        if boss._kopf is not None and boss._kopf.kopf_loop is not None and len(given or [""]) >= runs:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"kopf did not start {runs} time(s): {given}")


async def test_kopf_runs_in_its_own_thread_and_starts_again_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[str] = []
    fake_kopf(monkeypatch, runs)
    restarts = metrics.OPERATOR_METRICS.registry.get_sample_value("kvpolicy_operator_restarts_total") or 0
    boss = Supervisor(settings(), Configuration())
    stop = asyncio.Event()
    supervising = asyncio.create_task(boss.supervise(stop))
    await kopf_started(boss, runs=2, given=runs)
    status, report = await boss.health_report()
    assert status == 200 and report["status"] == "ok"
    assert report["operator"] == {
        "role": "single",
        "running": True,
        "restarts": 1,
        "lastFailure": "RuntimeError('a watcher failed')",
    }
    assert runs == ["kopf", "kopf"]
    stop.set()
    await asyncio.wait_for(supervising, 10)
    assert boss._kopf is None and len(runs) == 2
    assert metrics.OPERATOR_METRICS.registry.get_sample_value("kvpolicy_operator_restarts_total") == restarts + 1


async def test_healthz_fails_only_when_kopfs_loop_is_wedged(monkeypatch: pytest.MonkeyPatch) -> None:
    wedge = threading.Event()

    async def operator(stop_flag: threading.Event, **_: Any) -> None:
        while not stop_flag.is_set():
            if wedge.is_set():
                time.sleep(supervisor.KOPF_PING_SECONDS + 1)  # noqa: ASYNC251  # the point: kopf's loop is blocked
                wedge.clear()
            await asyncio.sleep(0.01)

    monkeypatch.setattr(supervisor.kopf, "operator", operator)
    boss = Supervisor(settings(), Configuration())
    boss.health.record("503", time.monotonic())  # an API outage: degraded, not failed
    stop = asyncio.Event()
    supervising = asyncio.create_task(boss.supervise(stop))
    await kopf_started(boss)
    status, report = await boss.health_report()
    assert (status, report["status"], report["api"]["reachable"]) == (200, "degraded", False)
    wedge.set()
    await asyncio.sleep(0.1)
    status, report = await boss.health_report()
    assert (status, report["status"]) == (503, "wedged")
    stop.set()
    await asyncio.wait_for(supervising, 10)


async def test_a_standby_runs_no_kopf_and_is_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[str] = []
    fake_kopf(monkeypatch, runs)
    election = LeaderElection("kvp-leader", NAMESPACE, "b")
    boss = Supervisor(settings(election), Configuration())

    class HeldByA:
        """A Lease that replica a keeps renewing: every read finds a fresh renewal."""

        async def get(self) -> LeaseRecord:
            return LeaseRecord("a", 15, renew_time=datetime.now(UTC))

        async def create(self, record: LeaseRecord) -> LeaseRecord:
            raise LeaseConflictError("exists")

        async def update(self, record: LeaseRecord) -> LeaseRecord:
            raise LeaseConflictError("changed")

    boss._elector = LeaderElector(HeldByA(), "b", clock=time.monotonic)
    electing = asyncio.create_task(boss._elector.run())
    stop = asyncio.Event()
    supervising = asyncio.create_task(boss.supervise(stop))
    await asyncio.sleep(0.2)
    status, report = await boss.health_report()
    assert (status, report["status"], report["operator"]["role"], report["operator"]["running"]) == (
        200,
        "ok",
        "standby",
        False,
    )
    assert report["leaderElection"] == {"lease": f"{NAMESPACE}/kvp-leader", "identity": "b", "holder": "a"}
    stop.set()
    await asyncio.wait_for(supervising, 5)
    electing.cancel()
    assert runs == []


@pytest.mark.looptime
async def test_loops_backing_off_after_an_api_failure_look_again_when_the_api_answers() -> None:
    api = FakeKubeApi(fail={"get": ApiError(503, "ServiceUnavailable", "etcd is down")})
    reconciler = Reconciler(api, CONFIG.__class__(**{**CONFIG.__dict__, "poll_seconds": 100.0}))

    class Never:
        def __bool__(self) -> bool:
            return False

        async def wait(self) -> None:
            await asyncio.Event().wait()

    loop = asyncio.get_running_loop()
    running = asyncio.create_task(reconciler.run_policy(NAMESPACE, "llama-fp8", "uid-1", Never()))
    await asyncio.sleep(1)
    assert api.calls == ["get kvpolicies"], "backing off (50 s after the first failure)"
    woken_at = loop.time()
    reconciler.wake_backing_off()
    await asyncio.wait_for(running, 5)  # the second look finds the policy gone, and the loop ends
    assert api.calls == ["get kvpolicies", "get kvpolicies"] and loop.time() - woken_at < 1
