"""kopf handlers, kept thin: each hands over to the `Reconciler` kept in kopf's memo.

They live in a registry of their own (`registry`), which `kvpolicy run` (and the tests' KopfRunner) hand to kopf, so
importing this module never changes what another kopf operator in the same process runs. Settings come from the memo
`kvpolicy run` passes, else from the environment (`OperatorOptions.from_env`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from kvpolicy import __version__
from kvpolicy.api.v1alpha1 import GROUP, PLURAL, VERSION
from kvpolicy.kube.api import KubeApi, KubernetesApi
from kvpolicy.kube.cached import CachedKubeApi, operator_selections
from kvpolicy.kube.leader import LeaderFencedApi
from kvpolicy.kube.login import ClusterLogin
from kvpolicy.kube.observe import LatencyAnalyser
from kvpolicy.kube.references import ReferenceReader
from kvpolicy.notify.notifier import DeliverySettings, Notifier, NotifierConfig
from kvpolicy.rollout.builders import POLICY_LABEL
from kvpolicy.rollout.step_types import StepConfig, default_gate_resources
from kvpolicy.runtime.reconciler import FINALIZER, Reconciler

DEFAULT_GATE_IMAGE = f"ghcr.io/kvpolicy/kvpolicy-operator:{__version__}"
# The FP8 serving image kernels/Dockerfile builds (vLLM v0.12.0 + kvkernels); it also runs the preflight probe.
DEFAULT_PROBE_IMAGE = f"ghcr.io/kvpolicy/vllm-fp8-twolevel:v0.12.0-kv{__version__}"


def _positive_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be above 0")
    return value


RESOURCES_EXAMPLE = '{"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}\''


def _resources(name: str) -> dict[str, Any] | None:
    """A container's `resources` as JSON in environment variable `name` (the chart's gateJobs values); None if unset."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"{name} is not JSON; give resources such as {RESOURCES_EXAMPLE}") from None
    parts_ok = isinstance(value, dict) and set(value) <= {"requests", "limits"}
    if not parts_ok or not all(
        isinstance(amounts, dict) and all(isinstance(amount, str | int) for amount in amounts.values())
        for amounts in value.values()
    ):
        raise ValueError(f"{name}={text} is not requests/limits of quantities, such as {RESOURCES_EXAMPLE}")
    resources: dict[str, Any] = value
    return resources


@dataclass(frozen=True)
class OperatorOptions:
    gate_image: str = DEFAULT_GATE_IMAGE
    probe_image: str = DEFAULT_PROBE_IMAGE
    poll_seconds: float = 5.0
    idle_seconds: float = 300.0
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    notifications: NotifierConfig = field(default_factory=NotifierConfig)
    gate_resources: dict[str, Any] = field(default_factory=default_gate_resources)
    preflight_resources: dict[str, Any] = field(default_factory=dict)
    # ReplicaRatio policies look for an InferencePool selecting their target (chart: gatewayAPI.enabled grants it).
    read_inference_pools: bool = False

    @classmethod
    def from_env(cls, metrics_port: int | None = None, metrics_address: str = "0.0.0.0") -> OperatorOptions:
        """KVPOLICY_GATE_IMAGE, KVPOLICY_PROBE_IMAGE, KVPOLICY_POLL_SECONDS, KVPOLICY_IDLE_SECONDS; notifications:
        KVPOLICY_NOTIFICATIONS, KVPOLICY_NAMESPACE, KVPOLICY_NOTIFY_ATTEMPTS, KVPOLICY_NOTIFY_TIMEOUT_SECONDS; the gate
        Jobs' resources as JSON: KVPOLICY_GATE_RESOURCES, KVPOLICY_PREFLIGHT_RESOURCES (besides its GPU);
        KVPOLICY_READ_INFERENCE_POOLS=true: ReplicaRatio policies look for InferencePools selecting their target."""
        defaults = cls()
        delivery = DeliverySettings(
            attempts=int(_positive_float("KVPOLICY_NOTIFY_ATTEMPTS", DeliverySettings.attempts)),
            timeout_seconds=_positive_float("KVPOLICY_NOTIFY_TIMEOUT_SECONDS", DeliverySettings.timeout_seconds),
        )
        notifications = NotifierConfig.parse(
            os.environ.get("KVPOLICY_NOTIFICATIONS", ""), os.environ.get("KVPOLICY_NAMESPACE", ""), delivery
        )
        return cls(
            gate_image=os.environ.get("KVPOLICY_GATE_IMAGE") or DEFAULT_GATE_IMAGE,
            probe_image=os.environ.get("KVPOLICY_PROBE_IMAGE") or DEFAULT_PROBE_IMAGE,
            poll_seconds=_positive_float("KVPOLICY_POLL_SECONDS", 5.0),
            idle_seconds=_positive_float("KVPOLICY_IDLE_SECONDS", 300.0),
            metrics_port=metrics_port,
            metrics_address=metrics_address,
            notifications=notifications,
            gate_resources=_resources("KVPOLICY_GATE_RESOURCES") or defaults.gate_resources,
            preflight_resources=_resources("KVPOLICY_PREFLIGHT_RESOURCES") or defaults.preflight_resources,
            read_inference_pools=os.environ.get("KVPOLICY_READ_INFERENCE_POOLS", "").lower() == "true",
        )

    def step_config(self) -> StepConfig:
        return StepConfig(
            gate_image=self.gate_image,
            probe_image=self.probe_image,
            poll_seconds=self.poll_seconds,
            idle_seconds=self.idle_seconds,
            gate_resources=self.gate_resources,
            preflight_resources=self.preflight_resources,
        )


class RetryForever:
    """kopf's `error_backoffs`: an iterable without a length, so that kopf retries a failed API request until it
    succeeds, as client-go's reflectors do. kopf's default (8 backoffs, 54 s) ends the watchers, and with them the
    operator, after about 85 s of 5xx. Each iteration starts the schedule again (one per request)."""

    def __init__(self, first: tuple[float, ...] = (1, 1, 2, 3, 5, 8, 13), then: float = 15.0) -> None:
        self.first = first
        self.then = then

    def __iter__(self) -> Iterator[float]:
        return itertools.chain(self.first, itertools.repeat(self.then))


def ride_out_api_outages(settings: kopf.OperatorSettings) -> None:
    """kopf's networking for an API server that may go away for any length of time: retry forever, and notice a
    connection that died silently (no timeouts by default) so that its watch is made again."""
    settings.networking.error_backoffs = RetryForever()
    settings.networking.connect_timeout = 10.0
    settings.networking.request_timeout = 60.0
    settings.watching.connect_timeout = 10.0
    settings.watching.server_timeout = 300.0  # the API server ends a quiet watch after this, and kopf watches again
    settings.watching.client_timeout = 330.0


def _reconciler(memo: Any) -> Reconciler:
    reconciler: Reconciler = memo["reconciler"]
    return reconciler


def _cluster_login(memo: Any) -> ClusterLogin:
    """The credentials `kvpolicy run` found (in the memo), else the service account or the kubeconfig."""
    if memo.get("login") is None:
        memo["login"] = ClusterLogin.discover()
    login: ClusterLogin = memo["login"]
    return login


class NoDiffBaseStorage(kopf.DiffBaseStorage):
    """No last-handled configuration at all. kopf stores one so that its creation, update and resume handlers see
    what changed; this operator has none of those (the loops read the policy themselves, and on.delete needs no
    diff), so the copy only cost work: a PATCH of every new policy, and on every watch event a deep copy of the
    body and a JSON diff of it against the stored copy, most of kopf's CPU time with thousands of policies (issue 28).
    A full copy in an annotation also passed the API server's 256 KiB limit for a large but admitted policy. With
    the same empty essence stored and built, kopf sees no change to handle, only deletions."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return cast(kopf.BodyEssence, {})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return cast(kopf.BodyEssence, {})

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        """Nothing to keep (kopf calls this only when `fetch` and `build` differ, which they never do)."""


registry = kopf.OperatorRegistry()


@kopf.on.login(registry=registry)
async def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf authenticates as the operator's own client does (exec plugins included), and asks again after a 401."""
    return await _cluster_login(memo).connection_info()


@kopf.on.startup(registry=registry)
async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBaseStorage()
    # The loops hold and finalize deletions themselves (reconciler.FINALIZER): kopf has no deletion handler, and must
    # never take the loops' finalizer for its own, which it would remove as one no handler needs.
    settings.persistence.finalizer = f"{GROUP}/kopf-finalizer"
    # The operator posts its own events with specific reasons; kopf's per-handler chatter would only add API load.
    settings.posting.level = logging.ERROR
    ride_out_api_outages(settings)
    options: OperatorOptions = memo.get("options") or OperatorOptions.from_env()
    # The children each pass lists, and the nodes' labels, come from watches (kube/cached.py).
    api: KubeApi = CachedKubeApi(await KubernetesApi.connect(_cluster_login(memo)), operator_selections(POLICY_LABEL))
    memo["api"] = api
    fence = memo.get("fence")
    if fence is not None:  # leader election (supervisor.py): write only while this replica holds the Lease
        api = LeaderFencedApi(api, fence)
    notifier = Notifier(api, options.notifications.receivers(), options.notifications.settings)
    memo["reconciler"] = Reconciler(
        api,
        options.step_config(),
        LatencyAnalyser(references=ReferenceReader(api)),
        notifier=notifier,
        read_inference_pools=options.read_inference_pools,
    )


@kopf.on.cleanup(registry=registry)
async def shutdown(memo: Any, **_: Any) -> None:
    reconciler = memo.get("reconciler")
    if reconciler is not None:
        await reconciler.stop_all()
    if reconciler is not None and reconciler.analyser is not None:
        await reconciler.analyser.close()
    if reconciler is not None and reconciler.notifier is not None:
        await reconciler.notifier.close()
    if memo.get("api") is not None:
        await memo["api"].close()


@kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
async def watched(body: kopf.Body, event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """Run one loop per KVPolicy for its whole life (all its progress is in its status), started by its first event
    (the initial list's included); wake it at once when its spec changes or its deletion starts, instead of at its
    next requeue. A policy being deleted that still has the loops' finalizer gets a loop too (one that was being
    deleted while no operator ran): the loop removes its children and releases it. Once a policy is gone, wake those
    that waited for its target. Async, so that it runs on kopf's loop, where the loops live (kopf runs a sync handler
    in a thread)."""
    if "reconciler" in memo:
        meta = body.get("metadata", {})
        reconciler = _reconciler(memo)
        namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid"))
        deleting = bool(meta.get("deletionTimestamp"))
        held = FINALIZER in (meta.get("finalizers") or [])
        if event.get("type") != "DELETED" and (held or not deleting) and not reconciler.running(uid):
            reconciler.start(
                namespace, name, uid, {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), **body}
            )
        reconciler.notice(uid, meta.get("generation"), deleting)
        if event.get("type") == "DELETED":
            reconciler.released(namespace, name)
