"""The leader elector under fake time (looptime): one Lease with optimistic concurrency, two replicas, and the ways a
leader goes away (killed, cut off from the API, hung requests, shutting down). At no instant may both act."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest
from fake_kube import FakeKubeApi
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import load_kube_config
from kvpolicy.kube.api import DEPLOYMENTS, ApiError
from kvpolicy.kube.leader import (
    KubernetesLeaseStore,
    LeaderElection,
    LeaderElector,
    LeaderFencedApi,
    LeaseConflictError,
    LeaseRecord,
    LeaseTiming,
    NotLeaderError,
)
from kvpolicy_dev.devcluster import ThreadedDevCluster
from operator_helpers import NAMESPACE, target_deployment

TIMING = LeaseTiming()  # 10 / 7 / 2 s


@dataclass
class Lease:
    """One stored Lease: every write takes the next resourceVersion; a stale one is a conflict."""

    record: LeaseRecord | None = None
    version: int = 0
    writes: list[tuple[float, str | None]] = field(default_factory=list)  # (loop time, holder written)

    def write(self, record: LeaseRecord) -> LeaseRecord:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        self.writes.append((asyncio.get_running_loop().time(), record.holder))
        return self.record


@dataclass
class Replica:
    """One replica's view of the Lease API, which the test can cut off (requests fail) or hang (never answer)."""

    lease: Lease
    cut_off: bool = False
    hanging: bool = False

    async def _reach(self) -> None:
        if self.hanging:
            await asyncio.Event().wait()
        if self.cut_off:
            raise ConnectionError("the API server does not answer")

    async def get(self) -> LeaseRecord | None:
        await self._reach()
        return self.lease.record

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        await self._reach()
        if self.lease.record is not None:
            raise LeaseConflictError("exists")
        return self.lease.write(record)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        await self._reach()
        if self.lease.record is None or record.resource_version != self.lease.record.resource_version:
            raise LeaseConflictError("stale")
        return self.lease.write(record)


@dataclass
class Cluster:
    lease: Lease
    replicas: dict[str, Replica]
    electors: dict[str, LeaderElector]
    tasks: dict[str, asyncio.Task[None]]
    overlaps: list[float] = field(default_factory=list)

    def leaders(self) -> list[str]:
        return [name for name, elector in self.electors.items() if elector.is_leader()]

    def kill(self, name: str) -> None:
        """SIGKILL: the loop stops where it is, nothing is released."""
        self.tasks[name].cancel()


async def wait_for(check: Callable[[], bool], within: float) -> float:
    """Fake seconds until `check()` holds, polling every 0.1 s; fails after `within`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not check():
        assert loop.time() - start < within, f"not within {within} s"
        await asyncio.sleep(0.1)
    return loop.time() - start


@contextlib.asynccontextmanager
async def cluster(*names: str) -> AsyncIterator[Cluster]:
    lease = Lease()
    replicas = {name: Replica(lease) for name in names}
    electors = {name: LeaderElector(replicas[name], name, TIMING) for name in names}
    tasks = {name: asyncio.create_task(electors[name].run()) for name in names}
    world = Cluster(lease, replicas, electors, tasks)

    async def referee() -> None:  # samples every 100 ms of fake time: never two at once
        while True:
            if len(world.leaders()) > 1:
                world.overlaps.append(asyncio.get_running_loop().time())
            await asyncio.sleep(0.1)

    watching = asyncio.create_task(referee())
    try:
        yield world
    finally:
        for task in [*tasks.values(), watching]:
            task.cancel()
        await asyncio.gather(*tasks.values(), watching, return_exceptions=True)
    assert world.overlaps == [], "two replicas acted at once"


@pytest.mark.looptime
async def test_one_replica_leads_and_the_other_stands_by() -> None:
    async with cluster("a", "b") as world:
        await wait_for(lambda: len(world.leaders()) == 1, within=1)
        await asyncio.sleep(120)
        [leader] = world.leaders()
        assert world.electors[leader].holder == leader and world.lease.record.holder == leader
        renewals = [holder for _, holder in world.lease.writes]
        assert set(renewals) == {leader} and len(renewals) >= 120 / TIMING.retry_seconds - 1
        assert world.lease.record.transitions == 0


@pytest.mark.looptime
async def test_a_killed_leader_is_replaced_within_the_lease_duration() -> None:
    async with cluster("a", "b") as world:
        await wait_for(lambda: world.leaders() == ["a"], within=1)
        await asyncio.sleep(31)  # a few renewals in
        world.kill("a")
        took = await wait_for(lambda: world.leaders() == ["b"], within=30)
        assert TIMING.lease_seconds - TIMING.retry_seconds <= took <= TIMING.lease_seconds + TIMING.retry_seconds
        assert world.lease.record.holder == "b" and world.lease.record.transitions == 1


@pytest.mark.looptime
async def test_a_standby_takes_over_at_the_expiry_it_saw_not_at_its_next_poll() -> None:
    """b reads the Lease a fraction of a period after each of a's renewals. It sees a's last renewal that late and must
    take over lease_seconds after that, not at its first poll past the expiry (up to a retry period later; a lease
    that is not a whole number of retries makes that visible in fake time)."""
    timing = LeaseTiming(lease_seconds=9.0, renew_deadline_seconds=7.0, retry_seconds=2.0)
    lease = Lease()
    replicas = {name: Replica(lease) for name in "ab"}
    electors = {name: LeaderElector(replicas[name], name, timing) for name in "ab"}
    tasks = [asyncio.create_task(electors["a"].run())]
    try:
        await wait_for(lambda: electors["a"].is_leader(), within=1)
        await asyncio.sleep(timing.retry_seconds / 4)  # a renews at whole periods, b will read in between
        tasks.append(asyncio.create_task(electors["b"].run()))
        b_started = asyncio.get_running_loop().time()
        await asyncio.sleep(21)
        tasks[0].cancel()  # SIGKILL
        await wait_for(lambda: electors["b"].is_leader(), within=30)
        last_renewal = max(moment for moment, holder in lease.writes if holder == "a")
        taken = next(moment for moment, holder in lease.writes if holder == "b")
        observed_late = (b_started - lease.writes[0][0]) % timing.retry_seconds  # b reads after each renewal
        assert 0 < observed_late < timing.retry_seconds / 2
        assert taken - last_renewal == pytest.approx(timing.lease_seconds + observed_late, abs=0.01)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("failure", ["cut_off", "hanging"])
@pytest.mark.looptime
async def test_a_leader_cut_off_from_the_api_stops_acting_before_anyone_takes_over(failure: str) -> None:
    async with cluster("a", "b") as world:
        await wait_for(lambda: world.leaders() == ["a"], within=1)
        await asyncio.sleep(11)
        last_renewal = world.lease.writes[-1][0]
        setattr(world.replicas["a"], failure, True)  # a partition: a still runs, its requests fail or hang
        loop = asyncio.get_running_loop()
        await wait_for(lambda: not world.electors["a"].is_leader(), within=15)
        stopped = loop.time()
        assert stopped - last_renewal <= TIMING.renew_deadline_seconds + 0.1
        await wait_for(lambda: world.leaders() == ["b"], within=30)
        taken = next(moment for moment, holder in world.lease.writes if holder == "b")
        assert taken - stopped >= TIMING.lease_seconds - TIMING.renew_deadline_seconds - TIMING.retry_seconds
        await wait_for(lambda: world.electors["a"]._standby_event.is_set(), within=1)

        setattr(world.replicas["a"], failure, False)  # the partition heals: a sees b's Lease and stands by
        await asyncio.sleep(60)
        assert world.leaders() == ["b"] and world.lease.record.holder == "b"


@pytest.mark.looptime
async def test_a_leader_that_shuts_down_hands_over_at_once() -> None:
    async with cluster("a", "b") as world:
        await wait_for(lambda: world.leaders() == ["a"], within=1)
        world.kill("a")
        await world.electors["a"].release()
        assert not world.electors["a"].is_leader() and world.lease.record.holder is None
        took = await wait_for(lambda: world.leaders() == ["b"], within=5)
        assert took <= TIMING.retry_seconds + 0.1


@pytest.mark.looptime
async def test_an_api_outage_leaves_no_leader_and_one_comes_back_after_it() -> None:
    async with cluster("a", "b", "c") as world:
        await wait_for(lambda: len(world.leaders()) == 1, within=1)
        for replica in world.replicas.values():
            replica.cut_off = True
        await wait_for(lambda: world.leaders() == [], within=TIMING.renew_deadline_seconds + 0.1)
        await asyncio.sleep(120)  # the elector loops keep trying, nothing ends
        assert not any(task.done() for task in world.tasks.values())
        for replica in world.replicas.values():
            replica.cut_off = False
        await wait_for(lambda: len(world.leaders()) == 1, within=TIMING.lease_seconds + TIMING.retry_seconds)


@pytest.mark.looptime
async def test_candidates_racing_for_a_new_lease_elect_one() -> None:
    async with cluster(*"abcdefgh") as world:
        await asyncio.sleep(10)
        assert len(world.leaders()) == 1 and world.lease.version >= 1


@pytest.mark.looptime
async def test_the_fence_refuses_writes_once_the_lease_is_lost() -> None:
    async with cluster("a") as world:
        elector = world.electors["a"]
        await wait_for(elector.is_leader, within=1)
        api = FakeKubeApi()
        fenced = LeaderFencedApi(api, elector.is_leader)
        assert await fenced.create(DEPLOYMENTS, NAMESPACE, target_deployment())
        world.replicas["a"].cut_off = True
        await asyncio.sleep(TIMING.renew_deadline_seconds)
        assert await fenced.get(DEPLOYMENTS, NAMESPACE, "llama") is not None, "reads still pass"
        writes = [
            fenced.patch(DEPLOYMENTS, NAMESPACE, "llama", {"metadata": {"labels": {"x": "y"}}}),
            fenced.delete(DEPLOYMENTS, NAMESPACE, "llama"),
            fenced.create(DEPLOYMENTS, NAMESPACE, target_deployment()),
            fenced.post_event(NAMESPACE, {}),
        ]
        for write in writes:
            with pytest.raises(NotLeaderError) as refused:
                await write
            assert refused.value.retryable and isinstance(refused.value, ApiError)
        assert [call for call in api.calls if not call.startswith("get")] == ["create deployments"]


def test_timings_that_would_let_two_act_are_refused() -> None:
    with pytest.raises(ValueError, match="retry_seconds < renew_deadline_seconds < lease_seconds, got 2 < 15 < 15"):
        LeaseTiming(lease_seconds=15, renew_deadline_seconds=15, retry_seconds=2)


def test_election_settings_come_from_the_charts_environment() -> None:
    assert LeaderElection.from_env({}) is None
    env = {"KVPOLICY_LEADER_ELECTION_LEASE": "kvp-leader", "KVPOLICY_LEADER_ELECTION_NAMESPACE": "ops"}
    assert LeaderElection.from_env({**env, "KVPOLICY_POD_NAME": "kvp-0"}) == LeaderElection(
        "kvp-leader", "ops", "kvp-0"
    )
    assert LeaderElection.from_env(env).identity != LeaderElection.from_env(env).identity, "unique without a pod name"
    with pytest.raises(ValueError, match="needs KVPOLICY_LEADER_ELECTION_NAMESPACE"):
        LeaderElection.from_env({"KVPOLICY_LEADER_ELECTION_LEASE": "kvp-leader"})


async def test_the_kubernetes_lease_store_writes_with_optimistic_concurrency(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    configuration = Configuration()
    await load_kube_config(config_file=str(devcluster.kubeconfig), client_configuration=configuration)
    moment = datetime(2026, 12, 1, 1, 2, 3, 456789, tzinfo=UTC)
    async with ApiClient(configuration) as client:
        store = KubernetesLeaseStore(client, ns, "kvp-leader")
        assert await store.get() is None
        created = await store.create(LeaseRecord("a", 15, moment, moment))
        with pytest.raises(LeaseConflictError):
            await store.create(LeaseRecord("b", 15, moment, moment))
        renewed = await store.update(replace(created, renew_time=moment + timedelta(seconds=2)))
        with pytest.raises(LeaseConflictError, match="changed since it was read"):
            await store.update(replace(created, holder="b"))  # read before a's renewal: loses
        assert await store.get() == renewed and renewed.holder == "a" and renewed.transitions == 0
    spec = devcluster.get("coordination.k8s.io/v1", "Lease", "kvp-leader", ns)["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 15
    assert spec["renewTime"].startswith("2026-12-01T01:02:05.456789")
