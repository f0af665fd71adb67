"""Leader election on a coordination.k8s.io/v1 Lease: of several operator replicas, one acts at a time.

The protocol is client-go's: a candidate reads the Lease; it takes it when nobody holds it or when the record has not
changed for `lease_seconds` on the candidate's own clock, by an update carrying the resourceVersion it read, so that
of two candidates racing one gets 409 Conflict. The holder renews it every `retry_seconds`.

No two actors: the holder acts only while `is_leader()`, that is until `renew_deadline_seconds` after its last
successful renewal, counted from before that renewal's request was sent. A standby takes over no earlier than
`lease_seconds` after it saw that renewal, so the old leader has stopped `lease_seconds - renew_deadline_seconds` (3 s
by default) before anyone else may start, however long its requests hang (argo-rollouts#2117 lost that when a renewal
blocked). Only the clocks' rates must agree, not their readings. kubernetes_asyncio's own `leaderelection` keeps
leading until a renewal that may hang returns and reads the wall clock, hence this small elector.

A leader that loses the Lease goes back to standby in the same process rather than exiting: during an API outage
every replica loses it, and exiting would only turn the outage into restarts and CrashLoopBackOff.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Protocol

from kubernetes_asyncio.client import ApiClient, CoordinationV1Api, V1Lease, V1LeaseSpec, V1ObjectMeta
from kubernetes_asyncio.client.exceptions import ApiException

from kvpolicy.kube.api import ApiError, FieldEquals, KubeApi, PatchType, Resource
from kvpolicy.kube.login import ClusterLogin

logger = logging.getLogger(__name__)
Obj = dict[str, Any]

LEASE_ENV = "KVPOLICY_LEADER_ELECTION_LEASE"
NAMESPACE_ENV = "KVPOLICY_LEADER_ELECTION_NAMESPACE"
POD_NAME_ENV = "KVPOLICY_POD_NAME"


@dataclass(frozen=True)
class LeaseTiming:
    """A standby takes over `lease_seconds` after it saw the leader's last renewal (it reads the Lease every retry, so
    up to one retry after the renewal itself): 10-12 s after a leader's loss, leaving ~3 s within the 15 s goal for
    the new leader's first action. client-go's defaults (15 / 10 / 2) took 15-17 s before anything could act. The
    leader still renews every 2 s and tolerates 7 s of failed renewals (three tries) before it stops acting."""

    lease_seconds: float = 10.0
    renew_deadline_seconds: float = 7.0
    retry_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(
                "leader election needs 0 < retry_seconds < renew_deadline_seconds < lease_seconds, got "
                f"{self.retry_seconds} < {self.renew_deadline_seconds} < {self.lease_seconds}"
            )


@dataclass(frozen=True)
class LeaderElection:
    """Where the Lease is and who this replica is (the chart's KVPOLICY_LEADER_ELECTION_* and KVPOLICY_POD_NAME)."""

    lease: str
    namespace: str
    identity: str
    timing: LeaseTiming = LeaseTiming()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> LeaderElection | None:
        """None unless KVPOLICY_LEADER_ELECTION_LEASE is set; ValueError naming what is missing."""
        env = dict(os.environ if environ is None else environ)
        lease = env.get(LEASE_ENV)
        if not lease:
            return None
        namespace = env.get(NAMESPACE_ENV)
        if not namespace:
            raise ValueError(f"{LEASE_ENV}={lease!r} needs {NAMESPACE_ENV}: the namespace of the Lease")
        # client-go's advice: the pod name where there is one, else something unique to this process.
        identity = env.get(POD_NAME_ENV) or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        return cls(lease=lease, namespace=namespace, identity=identity)


# ------------------------------------------------------------------------------------------------------------ lease


@dataclass(frozen=True)
class LeaseRecord:
    """The spec of a Lease, and the resourceVersion it was read at (None for one not stored yet)."""

    holder: str | None
    lease_seconds: int | None = None
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0
    resource_version: str | None = None

    def same_term(self, other: LeaseRecord) -> bool:
        """The same record as far as a candidate watching for changes cares (resourceVersions aside)."""
        return replace(self, resource_version=None) == replace(other, resource_version=None)


class LeaseConflictError(Exception):
    """Someone else wrote the Lease first (409 on create or update)."""


class LeaseStore(Protocol):
    """The Lease API the elector needs: one named Lease, read and written with optimistic concurrency."""

    async def get(self) -> LeaseRecord | None:
        """The Lease, or None when there is none."""
        ...

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        """Create it; LeaseConflictError when it exists."""
        ...

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        """Replace it if still at `record.resource_version`; LeaseConflictError otherwise."""
        ...


class KubernetesLeaseStore:
    """A coordination.k8s.io/v1 Lease through kubernetes_asyncio. Every request gives up after `timeout_seconds`."""

    def __init__(
        self,
        api_client: ApiClient,
        namespace: str,
        name: str,
        login: ClusterLogin | None = None,
        timeout_seconds: float = 5.0,
    ) -> None:
        self._api = CoordinationV1Api(api_client)
        self._login = login  # to load rotated credentials after a 401 instead of losing the Lease until the re-read
        self.namespace = namespace
        self.name = name
        self.timeout_seconds = timeout_seconds

    async def get(self) -> LeaseRecord | None:
        try:
            lease = await self._send(
                lambda: self._api.read_namespaced_lease(
                    self.name, self.namespace, _request_timeout=self.timeout_seconds
                )
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return _record(lease)

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        body = V1Lease(metadata=V1ObjectMeta(name=self.name, namespace=self.namespace), spec=_spec(record))
        try:
            created = await self._send(
                lambda: self._api.create_namespaced_lease(self.namespace, body, _request_timeout=self.timeout_seconds)
            )
        except ApiException as error:
            if error.status == 409:
                raise LeaseConflictError(f"Lease {self.namespace}/{self.name} exists") from error
            raise
        return _record(created)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        metadata = V1ObjectMeta(name=self.name, namespace=self.namespace, resource_version=record.resource_version)
        body = V1Lease(metadata=metadata, spec=_spec(record))
        try:
            replaced = await self._send(
                lambda: self._api.replace_namespaced_lease(
                    self.name, self.namespace, body, _request_timeout=self.timeout_seconds
                )
            )
        except ApiException as error:
            if error.status == 409:
                raise LeaseConflictError(f"Lease {self.namespace}/{self.name} changed since it was read") from error
            raise
        return _record(replaced)

    async def _send(self, request: Callable[[], Awaitable[V1Lease]]) -> V1Lease:
        if self._login is None:
            return await request()
        return await self._login.once_more_after_401(request)


def _spec(record: LeaseRecord) -> V1LeaseSpec:
    return V1LeaseSpec(
        holder_identity=record.holder,
        lease_duration_seconds=record.lease_seconds,
        acquire_time=record.acquire_time,
        renew_time=record.renew_time,
        lease_transitions=record.transitions,
    )


def _record(lease: V1Lease) -> LeaseRecord:
    spec = lease.spec or V1LeaseSpec()
    return LeaseRecord(
        holder=spec.holder_identity or None,
        lease_seconds=spec.lease_duration_seconds,
        acquire_time=spec.acquire_time,
        renew_time=spec.renew_time,
        transitions=spec.lease_transitions or 0,
        resource_version=lease.metadata.resource_version if lease.metadata else None,
    )


# ---------------------------------------------------------------------------------------------------------- elector


class Attempt(Enum):
    HELD = "held"  # this replica holds the Lease now
    REFUSED = "refused"  # someone else holds it (or won the race)
    FAILED = "failed"  # the API did not answer or refused the request


def _utcnow() -> datetime:
    return datetime.now(UTC)


class LeaderElector:
    """Runs the election (`run()`, for the life of the process) and tells whether this replica may act now."""

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        timing: LeaseTiming | None = None,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], datetime] = _utcnow,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.store = store
        self.identity = identity
        self.timing = timing or LeaseTiming()
        # Monotonic seconds; the running loop's clock by default (looptime fakes it in tests). A fence asked from
        # another thread (kopf's) needs a clock that thread can read too: pass time.monotonic.
        self._clock = clock
        self._wall_clock = wall_clock
        self._on_change = on_change
        self._leading = False
        self._renewed_at = 0.0
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._leading_event = asyncio.Event()
        self._standby_event = asyncio.Event()
        self._standby_event.set()

    def now(self) -> float:
        if self._clock is None:
            self._clock = asyncio.get_running_loop().time
        return self._clock()

    # ------------------------------------------------------------------------------------------------ the fence

    def is_leader(self) -> bool:
        """Whether this replica may act now: it holds the Lease and renewed it less than the renew deadline ago."""
        return self._leading and self.now() < self._renewed_at + self.timing.renew_deadline_seconds

    @property
    def holder(self) -> str | None:
        """The holder as last read (this replica's identity while it leads)."""
        return self._observed.holder if self._observed else None

    async def wait_until_leading(self) -> None:
        await self._leading_event.wait()

    async def wait_until_standby(self) -> None:
        await self._standby_event.wait()

    # ------------------------------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Acquire, renew until lost, and again, until cancelled. Never raises for an API failure."""
        while True:
            if not self._leading:
                await self._acquire()
            else:
                await self._renew_until_lost()

    async def _acquire(self) -> None:
        while True:  # polling is the protocol: a candidate learns of an expiry only by reading the Lease
            if await self._attempt() is Attempt.HELD:
                break
            await asyncio.sleep(self._until_next_try())
        self._set_leading(True)
        logger.info("leader election: %s now holds the Lease and acts", self.identity)

    def _until_next_try(self) -> float:
        """A retry period, or less when the Lease as last read expires sooner: the standby tries at the expiry itself
        rather than up to a retry period after it."""
        observed = self._observed
        if observed is None or observed.holder in (None, self.identity):
            return self.timing.retry_seconds
        expires = self._observed_at + (observed.lease_seconds or self.timing.lease_seconds)
        remaining = expires - self.now()
        # Past the expiry (another candidate won it meanwhile): the ordinary period, never a busy loop.
        return remaining if 0 < remaining < self.timing.retry_seconds else self.timing.retry_seconds

    async def _renew_until_lost(self) -> None:
        while True:
            await asyncio.sleep(self.timing.retry_seconds)
            deadline = self._renewed_at + self.timing.renew_deadline_seconds
            try:
                # A renewal still unanswered at the deadline is a failure: the fence has closed by then anyway.
                async with asyncio.timeout(max(0.0, deadline - self.now())):
                    outcome = await self._attempt()
            except TimeoutError:
                outcome = Attempt.FAILED
            if outcome is Attempt.REFUSED or (outcome is Attempt.FAILED and self.now() >= deadline):
                self._set_leading(False)
                why = f"{self.holder} holds it now" if outcome is Attempt.REFUSED else "could not renew it in time"
                logger.warning(
                    "leader election: %s lost the Lease (%s); stopped acting, standing by", self.identity, why
                )
                return

    async def _attempt(self) -> Attempt:
        """One try at acquiring or renewing (client-go's tryAcquireOrRenew)."""
        started = self.now()
        try:
            return await self._try_acquire_or_renew(started)
        except LeaseConflictError:
            return Attempt.REFUSED
        except Exception as error:  # the API's failures: a standby keeps trying, a leader until its deadline
            logger.debug("leader election: %s could not read or write the Lease: %r", self.identity, error)
            return Attempt.FAILED

    async def _try_acquire_or_renew(self, started: float) -> Attempt:
        current = await self.store.get()
        moment = self._wall_clock()
        mine = LeaseRecord(
            holder=self.identity,
            lease_seconds=round(self.timing.lease_seconds),
            acquire_time=moment,
            renew_time=moment,
        )
        if current is None:
            self._observe(await self.store.create(mine))
            self._renewed_at = started
            return Attempt.HELD
        if self._observed is None or not current.same_term(self._observed):
            self._observed, self._observed_at = current, self.now()
        lease_seconds = current.lease_seconds or self.timing.lease_seconds
        if current.holder not in (None, self.identity) and self.now() < self._observed_at + lease_seconds:
            return Attempt.REFUSED
        if current.holder == self.identity:
            mine = replace(mine, acquire_time=current.acquire_time, transitions=current.transitions)
        else:
            mine = replace(mine, transitions=current.transitions + 1)
        self._observe(await self.store.update(replace(mine, resource_version=current.resource_version)))
        self._renewed_at = started
        return Attempt.HELD

    def _observe(self, record: LeaseRecord) -> None:
        self._observed, self._observed_at = record, self.now()

    def _set_leading(self, leading: bool) -> None:
        self._leading = leading
        (self._leading_event if leading else self._standby_event).set()
        (self._standby_event if leading else self._leading_event).clear()
        if self._on_change is not None:
            self._on_change(leading)

    async def release(self) -> None:
        """Give the Lease up (shutting down): stop acting first, then let a standby take it at once (client-go's
        ReleaseOnCancel: no holder, a one-second duration). Best effort: unreleased, it expires by itself."""
        if not self._leading or self._observed is None:
            return
        self._set_leading(False)
        moment = self._wall_clock()
        released = replace(self._observed, holder=None, lease_seconds=1, acquire_time=moment, renew_time=moment)
        try:
            async with asyncio.timeout(self.timing.retry_seconds):
                self._observe(await self.store.update(released))
            logger.info("leader election: %s released the Lease", self.identity)
        except Exception as error:
            logger.warning(
                "leader election: %s could not release the Lease (%r); it expires by itself", self.identity, error
            )


# ------------------------------------------------------------------------------------------------------------ fence


class NotLeaderError(ApiError):
    """A write refused before it was sent: this replica does not hold the Lease (any more)."""

    def __init__(self, what: str) -> None:
        # Code 0, no HTTP answer: retryable, so a policy's loop backs off instead of failing while kopf stops.
        super().__init__(0, "NotLeader", f"{what} not sent: this replica does not hold the leader Lease")


class LeaderFencedApi:
    """A KubeApi whose writes happen only while `may_act()`: reads pass, writes raise NotLeaderError otherwise.

    Checked right before each request, so a pass that began as leader stops writing the moment the fence closes."""

    def __init__(self, api: KubeApi, may_act: Callable[[], bool]) -> None:
        self.api = api
        self.may_act = may_act

    def _check(self, what: str) -> None:
        if not self.may_act():
            raise NotLeaderError(what)

    async def get(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        return await self.api.get(resource, namespace, name)

    async def list_objects(
        self,
        resource: Resource,
        namespace: str | None,
        label_selector: str = "",
        since: Obj | None = None,
        where: FieldEquals | None = None,
    ) -> list[Obj]:
        return await self.api.list_objects(resource, namespace, label_selector, since, where)

    async def create(self, resource: Resource, namespace: str, body: Obj) -> bool:
        self._check(f"create {resource.plural}")
        return await self.api.create(resource, namespace, body)

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Obj | list[Obj],
        patch_type: PatchType = "merge",
        subresource: str | None = None,
    ) -> Obj | None:
        self._check(f"patch {resource.plural}/{name}")
        return await self.api.patch(resource, namespace, name, patch, patch_type, subresource)

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        self._check(f"delete {resource.plural}/{name}")
        return await self.api.delete(resource, namespace, name)

    async def post_event(self, namespace: str, body: Obj) -> None:
        self._check("event")
        await self.api.post_event(namespace, body)

    async def close(self) -> None:
        close = getattr(self.api, "close", None)
        if close is not None:
            await close()
