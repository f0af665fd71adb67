"""Notifications: tell webhooks about a rollout's phase changes, decisions and drift (the step's `Notice`s).

The payloads are pure (`payload`): a CloudEvents 1.0 event in structured JSON mode, a Slack incoming-webhook message,
or a Teams Workflows message carrying an Adaptive Card. Delivery is the edge (`Notifier`): the reconciler hands over
a step's notices after its status write and never waits; each receiver has a bounded queue (the oldest notice is
dropped when it is full) and one worker that sends in order, with a timeout per attempt and retries with exponential
backoff. A receiver that fails or hangs only delays its own queue: never a rollout, never another receiver.

A receiver's URL lives in a Secret (`urlSecretRef`); it is read when sending and never written to the status, an
event, a log line or a metric: receivers are named by `name` there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import TypeAdapter, ValidationError

from kvpolicy.api.reasons import Reason
from kvpolicy.api.v1alpha1 import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    KVPolicy,
    NotificationEvent,
    NotificationSpec,
    WebhookFormat,
)
from kvpolicy.kube.api import SECRETS, ApiError, KubeApi
from kvpolicy.kube.executor import post_events
from kvpolicy.notify import metrics
from kvpolicy.rollout.step_types import Event, Notice, timestamp

logger = logging.getLogger(__name__)
Obj = dict[str, Any]

CLOUDEVENTS_CONTENT_TYPE = "application/cloudevents+json"
JSON_CONTENT_TYPE = "application/json"
CLOUDEVENT_TYPES = {
    NotificationEvent.PHASE_CHANGED: "dev.kvpolicy.rollout.phase.changed",
    NotificationEvent.DECIDED: "dev.kvpolicy.rollout.decided",
    NotificationEvent.DRIFTED: "dev.kvpolicy.target.drifted",
}


@dataclass(frozen=True)
class Receiver:
    """A webhook: its spec, and the namespace of the Secret holding its URL."""

    namespace: str
    spec: NotificationSpec

    @property
    def key(self) -> tuple[str, ...]:
        ref = self.spec.url_secret_ref
        return (self.namespace, ref.name, ref.key, self.spec.format.value, self.spec.name)

    def describe(self) -> str:
        ref = self.spec.url_secret_ref
        return f"receiver {self.spec.name} (Secret {self.namespace}/{ref.name}, key {ref.key})"


@dataclass(frozen=True)
class Source:
    """The policy a notice is about."""

    name: str
    namespace: str
    uid: str
    generation: int
    target: str

    @classmethod
    def of(cls, policy: KVPolicy) -> Source:
        meta = policy.metadata
        return cls(
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace", "")),
            uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation") or 1),
            target=policy.spec.target_ref.name,
        )

    @property
    def path(self) -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}/{self.name}"

    def as_involved_object(self) -> Obj:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
        }


def receivers(policy: KVPolicy, defaults: Sequence[Receiver]) -> list[Receiver]:
    """The policy's own receivers, else the operator's defaults."""
    own = policy.spec.notifications
    if own is None:
        return list(defaults)
    return [Receiver(str(policy.metadata.get("namespace", "")), spec) for spec in own]


# -------------------------------------------------------------------------------------------------------- payloads


def _title(notice: Notice, source: Source) -> str:
    where = f"{source.namespace}/{source.name}"
    if notice.kind == NotificationEvent.DECIDED and notice.decision is not None:
        return f"KVPolicy {where}: {notice.decision.result.value} ({notice.decision.reason})"
    if notice.kind == NotificationEvent.DRIFTED:
        return f"KVPolicy {where}: target {source.target} drifted"
    before = notice.previous_phase.value if notice.previous_phase else "new"
    return f"KVPolicy {where}: {before} -> {notice.phase.value}"


def _data(notice: Notice, source: Source) -> Obj:
    data: Obj = {
        "policy": source.name,
        "namespace": source.namespace,
        "target": source.target,
        "generation": source.generation,
        "rolloutId": notice.rollout_id,
        "phase": notice.phase.value,
        "previousPhase": notice.previous_phase.value if notice.previous_phase else None,
        "message": notice.message,
    }
    if notice.decision is not None:
        data["decision"] = notice.decision.to_k8s()
    if notice.differences:
        data["differences"] = [difference.to_k8s() for difference in notice.differences]
    return data


def event_id(notice: Notice, source: Source) -> str:
    """Stable for one notice, so a receiver can drop a duplicate (a step replayed after a lost status write)."""
    parts = (source.uid, notice.rollout_id or "", notice.kind.value, notice.phase.value, timestamp(notice.at))
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:32]


def payload(format_: WebhookFormat, notice: Notice, source: Source) -> tuple[Obj, str]:
    """The request body and its content type."""
    title = _title(notice, source)
    if format_ == WebhookFormat.SLACK:
        text = f"*{title}*\n{notice.message}"
        return {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}, (
            JSON_CONTENT_TYPE
        )
    if format_ == WebhookFormat.TEAMS:
        facts = [
            {"title": "Phase", "value": notice.phase.value},
            {"title": "Rollout", "value": notice.rollout_id or "-"},
            {"title": "Target", "value": f"Deployment {source.target}"},
        ]
        card = {
            "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
            "type": "AdaptiveCard",
            "version": "1.4",
            "body": [
                {"type": "TextBlock", "text": title, "weight": "Bolder", "size": "Medium", "wrap": True},
                {"type": "TextBlock", "text": notice.message, "wrap": True},
                {"type": "FactSet", "facts": facts},
            ],
        }
        attachment = {"contentType": "application/vnd.microsoft.card.adaptive", "contentUrl": None, "content": card}
        return {"type": "message", "attachments": [attachment]}, JSON_CONTENT_TYPE
    event = {
        "specversion": "1.0",
        "id": event_id(notice, source),
        "source": source.path,
        "type": CLOUDEVENT_TYPES[notice.kind],
        "subject": source.name,
        "time": timestamp(notice.at),
        "datacontenttype": JSON_CONTENT_TYPE,
        "data": _data(notice, source),
    }
    return event, CLOUDEVENTS_CONTENT_TYPE


# -------------------------------------------------------------------------------------------------------- delivery


@dataclass(frozen=True)
class DeliverySettings:
    """How hard the notifier tries. Defaults: 5 attempts 5 s each, 1, 2, 4, 8 s apart (with jitter): a receiver that
    is down gets about 45 s per notice before it is given up; 100 notices wait per receiver at most."""

    attempts: int = 5
    timeout_seconds: float = 5.0
    backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0
    queue_size: int = 100
    secret_ttl_seconds: float = 60.0
    idle_seconds: float = 600.0  # a worker whose queue stays empty this long stops


@dataclass(frozen=True)
class _Delivery:
    receiver: Receiver
    source: Source
    notice: Notice


class DeliveryError(Exception):
    """Why one attempt failed, in words that never contain the URL."""


class Notifier:
    """Queues notices per receiver and delivers them in the background; `submit` never waits."""

    def __init__(
        self,
        api: KubeApi,
        defaults: Sequence[Receiver] = (),
        settings: DeliverySettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.defaults = tuple(defaults)
        self.settings = settings or DeliverySettings()
        self._clock = clock
        self._queues: dict[tuple[str, ...], asyncio.Queue[_Delivery]] = {}
        self._workers: dict[tuple[str, ...], asyncio.Task[None]] = {}
        self._urls: dict[tuple[str, str, str], tuple[float, str]] = {}
        self._failing: set[tuple[str, ...]] = set()
        self._session: aiohttp.ClientSession | None = None

    def submit(self, policy: KVPolicy, notices: Sequence[Notice]) -> None:
        if not notices:
            return
        source = Source.of(policy)
        for receiver in receivers(policy, self.defaults):
            for notice in notices:
                if notice.kind in receiver.spec.events:
                    self._enqueue(_Delivery(receiver, source, notice))

    def _enqueue(self, delivery: _Delivery) -> None:
        key = delivery.receiver.key
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = asyncio.Queue(maxsize=self.settings.queue_size)
        if queue.full():
            dropped = queue.get_nowait()
            queue.task_done()
            metrics.record_notification(dropped.receiver.spec.format.value, "dropped")
            logger.warning("%s: queue full, dropped the oldest notice", delivery.receiver.describe())
        queue.put_nowait(delivery)
        worker = self._workers.get(key)
        if worker is None or worker.done():
            self._workers[key] = asyncio.get_running_loop().create_task(self._work(key, queue))

    async def _work(self, key: tuple[str, ...], queue: asyncio.Queue[_Delivery]) -> None:
        while True:
            try:
                delivery = await asyncio.wait_for(queue.get(), timeout=self.settings.idle_seconds)
            except TimeoutError:
                if queue.empty():
                    self._workers.pop(key, None)
                    self._queues.pop(key, None)
                    return
                continue
            try:
                await self._deliver(delivery)
            except Exception:  # a bug must not stop the receiver's queue for good
                logger.exception("%s: delivery failed unexpectedly", delivery.receiver.describe())
            finally:
                queue.task_done()

    async def _deliver(self, delivery: _Delivery) -> None:
        receiver, settings = delivery.receiver, self.settings
        format_ = receiver.spec.format
        body, content_type = payload(format_, delivery.notice, delivery.source)
        problem = "not attempted"
        for attempt in range(1, settings.attempts + 1):
            try:
                url = await self._url(receiver)
                await self._post(url, body, content_type)
            except DeliveryError as error:
                problem = str(error)
                logger.info("%s: attempt %d/%d failed: %s", receiver.describe(), attempt, settings.attempts, problem)
                if attempt < settings.attempts:
                    delay = min(settings.max_backoff_seconds, settings.backoff_seconds * 2 ** (attempt - 1))
                    await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                continue
            metrics.record_notification(format_.value, "sent")
            if receiver.key in self._failing:
                self._failing.discard(receiver.key)
                logger.info("%s: delivering again", receiver.describe())
            return
        metrics.record_notification(format_.value, "failed")
        message = f"{receiver.describe()}: gave up after {settings.attempts} attempts ({problem})"
        logger.warning("%s", message)
        if receiver.key not in self._failing:  # one event per failing streak, not one per notice
            self._failing.add(receiver.key)
            event = Event("Warning", Reason.NOTIFICATION_FAILED, message)
            with contextlib.suppress(ApiError):
                await post_events(self.api, delivery.source.as_involved_object(), [event], delivery.notice.at)

    async def _url(self, receiver: Receiver) -> str:
        ref = receiver.spec.url_secret_ref
        cache_key = (receiver.namespace, ref.name, ref.key)
        cached = self._urls.get(cache_key)
        now = self._clock()
        if cached is not None and cached[0] > now:
            return cached[1]
        where = f"Secret {receiver.namespace}/{ref.name}"
        try:
            secret = await self.api.get(SECRETS, receiver.namespace, ref.name)
        except ApiError as error:
            raise DeliveryError(f"cannot read {where}: {error.code} {error.reason}") from None
        if secret is None:
            raise DeliveryError(f"{where} not found")
        encoded = (secret.get("data") or {}).get(ref.key)
        if encoded is None:
            raise DeliveryError(f"{where} has no key {ref.key}")
        try:
            url = base64.b64decode(encoded).decode().strip()
        except ValueError:
            raise DeliveryError(f"{where} key {ref.key} is not base64 UTF-8 text") from None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise DeliveryError(f"{where} key {ref.key} is not an http(s) URL")
        self._urls[cache_key] = (now + self.settings.secret_ttl_seconds, url)
        return url

    async def _post(self, url: str, body: Obj, content_type: str) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_seconds),
                headers={"User-Agent": "kvpolicy-operator"},
            )
        try:
            async with self._session.post(url, json=body, headers={"Content-Type": content_type}) as response:
                # Never read the body into anything kept: it is the receiver's, and may say anything.
                if response.status >= 300:
                    raise DeliveryError(f"HTTP {response.status}")
        except TimeoutError:
            raise DeliveryError(f"no answer within {self.settings.timeout_seconds:g} s") from None
        except aiohttp.ClientError as error:
            # aiohttp's messages name the host and port: only the kind of failure is kept.
            raise DeliveryError(f"connection failed ({type(error).__name__})") from None

    async def drained(self) -> None:
        """Wait until every queued notice was sent or given up (tests, and a clean shutdown)."""
        for queue in list(self._queues.values()):
            await queue.join()

    async def close(self) -> None:
        workers = list(self._workers.values())
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        self._workers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(frozen=True)
class NotifierConfig:
    """The operator's notification settings: default receivers (for policies without spec.notifications), the
    namespace of their Secrets (the operator's), and how hard to try."""

    defaults: tuple[NotificationSpec, ...] = ()
    namespace: str = ""
    settings: DeliverySettings = field(default_factory=DeliverySettings)

    def receivers(self) -> tuple[Receiver, ...]:
        return tuple(Receiver(self.namespace, spec) for spec in self.defaults)

    @classmethod
    def parse(cls, receivers_json: str, namespace: str, settings: DeliverySettings) -> NotifierConfig:
        """From KVPOLICY_NOTIFICATIONS (a JSON list of receivers, as in spec.notifications) and KVPOLICY_NAMESPACE
        (where their Secrets are). Raises ValueError naming the variable."""
        defaults: tuple[NotificationSpec, ...] = ()
        if receivers_json.strip():
            try:
                defaults = tuple(_DEFAULTS.validate_json(receivers_json))
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                raise ValueError(f"KVPOLICY_NOTIFICATIONS: {first['msg']} at {where or 'the top'}") from None
        if defaults and not namespace:
            raise ValueError("KVPOLICY_NOTIFICATIONS needs KVPOLICY_NAMESPACE: the namespace of the receivers' Secrets")
        return cls(defaults=defaults, namespace=namespace, settings=settings)


_DEFAULTS = TypeAdapter(list[NotificationSpec])
