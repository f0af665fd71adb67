"""The per-policy loop: read the policy, observe, step, apply, sleep until the step's requeue time or a spec change.

API failures that may pass (409, 429, 5xx, network) are retried with exponential backoff; nothing is lost because
the next pass observes again and every action is idempotent. Deleting a policy removes its children and leaves the
target in a stated configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

from kvpolicy import metrics
from kvpolicy.api.reasons import Reason
from kvpolicy.api.v1alpha1 import GateVerdict, KVPolicy, Phase
from kvpolicy.controller import builders as b
from kvpolicy.controller.executor import apply_actions, post_events, write_status
from kvpolicy.controller.kube import DEPLOYMENTS, JOBS, KVPOLICIES, SERVICES, ApiError, KubeApi, label_selector
from kvpolicy.controller.observe import LatencyAnalyser, Observer
from kvpolicy.controller.rules import phase_deadline
from kvpolicy.controller.state import Event, Observations, StepConfig, StepResult, parse_timestamp
from kvpolicy.controller.step import step

logger = logging.getLogger(__name__)
Obj = dict[str, Any]


class StopFlag(Protocol):
    """kopf's DaemonStopped, or anything truthy once the loop must end with an awaitable `wait()`."""

    def __bool__(self) -> bool: ...

    def wait(self) -> Awaitable[Any]: ...


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class Reconciler:
    api: KubeApi
    config: StepConfig
    analyser: LatencyAnalyser | None = None
    clock: Callable[[], datetime] = _utcnow
    max_backoff_seconds: float = 60.0
    _wake: dict[str, asyncio.Event] = field(default_factory=dict, init=False)
    _generations: dict[str, int] = field(default_factory=dict, init=False)
    _phases: dict[str, str] = field(default_factory=dict, init=False)
    # The policy as the API server returned it to this loop's last status write: the next pass starts from it
    # instead of reading the policy again, unless a watch event says the spec changed (or a write failed).
    _known: dict[str, Obj] = field(default_factory=dict, init=False)
    # Loops sleeping out a retryable API failure: `wake_backing_off` wakes them when the API server answers again.
    _backing_off: set[str] = field(default_factory=set, init=False)

    @property
    def observer(self) -> Observer:
        return Observer(self.api, self.analyser)

    # ----------------------------------------------------------------------------------------------------- waking

    def notice(self, uid: str, generation: int | None, deleting: bool) -> None:
        """A watch event for a policy: wake its loop early when the spec changed or it is being deleted."""
        seen = self._generations.get(uid)
        if deleting or (generation is not None and seen is not None and generation != seen):
            # What the loop last wrote is no longer the whole truth: read the policy again.
            self._known.pop(uid, None)
            self._wake.setdefault(uid, asyncio.Event()).set()

    def wake_backing_off(self) -> None:
        """The API server answers again (supervisor.py's probe): loops backing off after an API failure look again
        now rather than at the end of their backoff (up to a minute)."""
        for uid in self._backing_off:
            self._wake.setdefault(uid, asyncio.Event()).set()

    async def _sleep(self, uid: str, stopped: StopFlag, delay: float) -> None:
        event = self._wake.setdefault(uid, asyncio.Event())
        if not event.is_set() and delay > 0:

            async def until_stopped() -> None:
                await stopped.wait()

            waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(until_stopped())}
            try:
                await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
                await asyncio.gather(*waiters, return_exceptions=True)
        event.clear()

    # ------------------------------------------------------------------------------------------------------ loop

    async def run_policy(self, namespace: str, name: str, uid: str, stopped: StopFlag) -> None:
        failures = 0
        try:
            while not stopped:
                try:
                    delay = await self.reconcile_once(namespace, name, uid)
                    failures = 0
                    self._backing_off.discard(uid)
                except ApiError as error:
                    self._known.pop(uid, None)
                    if not error.retryable:
                        raise
                    self._backing_off.add(uid)
                    failures += 1
                    delay = self._backoff(failures)
                    metrics.record_reconcile_error(error.reason or str(error.code))
                    logger.warning("%s/%s: %s; retrying in %.1f s", namespace, name, error, delay)
                except Exception:
                    # A bug must not end the policy's loop for good: say so loudly and try again later.
                    self._known.pop(uid, None)
                    failures += 1
                    delay = self._backoff(failures)
                    metrics.record_reconcile_error("Unexpected")
                    logger.exception("%s/%s: unexpected error; retrying in %.1f s", namespace, name, delay)
                if delay is None:
                    return
                await self._sleep(uid, stopped, delay)
        finally:
            self._wake.pop(uid, None)
            self._generations.pop(uid, None)
            self._known.pop(uid, None)
            self._backing_off.discard(uid)

    def _backoff(self, failures: int) -> float:
        return min(self.max_backoff_seconds, self.config.poll_seconds * 2.0 ** min(failures, 10) / 4)

    async def reconcile_once(self, namespace: str, name: str, uid: str | None = None) -> float | None:
        """One pass; the seconds until the next one, or None when the policy is gone or being deleted."""
        raw = self._known.pop(uid, None) if uid else None
        if raw is None:
            raw = await self.api.get(KVPOLICIES, namespace, name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return None
        uid = raw["metadata"]["uid"]
        self._generations[uid] = int(raw["metadata"].get("generation") or 1)
        try:
            policy = KVPolicy.model_validate(raw)
        except ValidationError as error:
            # The API server's schema should have refused it; say what is wrong and wait for a fix.
            message = f"invalid KVPolicy: {error.errors()[0]['msg']} at {error.errors()[0]['loc']}"
            await post_events(self.api, raw, [Event("Warning", Reason.INVALID_SPEC, message)], self.clock())
            return self.config.idle_seconds
        now = self.clock()
        observations = await self.observer.observe(policy, now)
        result = step(policy, observations, self.config)
        await apply_actions(self.api, namespace, result.actions)
        status = result.status.to_k8s()
        written = await write_status(self.api, raw, status)
        if written is None:
            return None
        self._known[uid] = written
        await post_events(self.api, raw, result.events, now)
        self._record_metrics(policy, observations, result)
        return result.requeue_after

    def _record_metrics(self, policy: KVPolicy, observations: Observations, result: StepResult) -> None:
        namespace, name = str(policy.metadata["namespace"]), str(policy.metadata["name"])
        before, after = policy.status, result.status
        uid = str(policy.metadata.get("uid"))
        self._phases[uid] = after.phase or Phase.PLANNING
        metrics.set_policies_by_phase(Counter(self._phases.values()))
        if after.decision is not None and after.decision != before.decision:
            metrics.record_decision(after.decision.result, after.decision.reason, namespace, name)
            started = parse_timestamp(after.rollout_started_at)
            if started is not None:
                elapsed = (observations.now - started).total_seconds()
                metrics.observe_rollout_duration(elapsed, after.decision.result)
        old_probe = before.latency.probe if before.latency else None
        new_probe = after.latency.probe if after.latency else None
        if (
            new_probe is not None
            and new_probe.verdict != GateVerdict.RUNNING
            and (old_probe is None or old_probe.verdict == GateVerdict.RUNNING)
        ):
            metrics.record_gate_result(name, namespace, metrics.GATE_LATENCY, new_probe.verdict, None, None, None)
        old, new = before.accuracy, after.accuracy
        running = GateVerdict.RUNNING
        if new is not None and new.verdict != running and (old is None or old.verdict == running):
            metrics.record_gate_result(
                name, namespace, metrics.GATE_ACCURACY, new.verdict, new.recovery, new.canary_score, new.baseline_score
            )
        updated = policy.model_copy(update={"status": after})
        deadline = phase_deadline(updated)
        metrics.set_phase_deadline(namespace, name, after.phase or "", deadline.timestamp() if deadline else None)
        if observations.latency_verdict is not None:
            metrics.record_analysis(namespace, name, observations.latency_verdict)
        elif after.phase != Phase.LATENCY_ANALYSIS and before.phase == Phase.LATENCY_ANALYSIS:
            metrics.clear_analysis(namespace, name)

    # -------------------------------------------------------------------------------------------------- deletion

    async def cleanup(self, raw: Obj) -> str:
        """Remove the policy's children; finish restoring the target if a rollback was under way. Returns what the
        target is left running, for the event and the log."""
        meta = raw["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        policy = KVPolicy.model_validate(raw)
        selector = label_selector({b.POLICY_LABEL: name})
        for resource in (DEPLOYMENTS, SERVICES, JOBS):
            for child in await self.api.list_objects(resource, namespace, selector):
                await self.api.delete(resource, namespace, child["metadata"]["name"])
        self._phases.pop(str(meta.get("uid")), None)
        metrics.set_policies_by_phase(Counter(self._phases.values()))
        metrics.forget_policy(namespace, name)
        target = await self.api.get(DEPLOYMENTS, namespace, policy.spec.target_ref.name)
        if target is None:
            return f"target Deployment {policy.spec.target_ref.name} does not exist"
        previous = policy.status.previous_template
        if policy.status.phase == Phase.ROLLING_BACK and previous is not None:
            patch = b.container_patch(target, policy.spec.target_ref.container, previous)
            await self.api.patch(DEPLOYMENTS, namespace, target["metadata"]["name"], patch, "json")
            return f"{policy.spec.target_ref.name} restored to its recorded BF16 configuration (image {previous.image})"
        current = b.container_record(b.vllm_container(target, policy.spec.target_ref.container))
        dtype = "FP8" if b.runs_fp8(current) else "BF16"
        return f"{policy.spec.target_ref.name} left as it runs: {dtype} KV cache, image {current.image}"


async def close(reconciler: Reconciler) -> None:
    if reconciler.analyser is not None:
        with contextlib.suppress(Exception):
            await reconciler.analyser.close()
