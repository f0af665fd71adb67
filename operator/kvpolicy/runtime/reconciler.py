"""The per-policy loop: read the policy, observe, step, apply, sleep until the step's requeue time or a spec change.

API failures that may pass (409, 429, 5xx, network) are retried with exponential backoff; nothing is lost because
the next pass observes again and every action is idempotent. A request the API server refuses for good (422, 403,
...), an invalid spec and a target another policy governs are said in the `Ready` condition, a Warning event (when
that changes) and the reconcile-error metric, and the loop goes on: the phase deadlines still fire. Deleting a policy
removes its children and leaves the target in a stated configuration, whether its spec is valid or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

from kvpolicy.api.reasons import Reason
from kvpolicy.api.v1alpha1 import (
    API_VERSION,
    GROUP,
    KIND,
    TERMINAL_PHASES,
    Condition,
    ConditionStatus,
    ConditionType,
    KVPolicy,
    KVPolicySpec,
    KVPolicyStatus,
    Phase,
    PodTemplateRecord,
    TargetRef,
)
from kvpolicy.kube.api import JOBS, KVPOLICIES, REQUEST_CONNECTIONS, SERVICES, ApiError, KubeApi, label_selector
from kvpolicy.kube.executor import Rejected, apply_actions, post_events, resource_for, write_status
from kvpolicy.kube.observe import LatencyAnalyser, Observer, traffic_objects
from kvpolicy.notify import metrics
from kvpolicy.notify.notifier import Notifier
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.conditions import set_condition
from kvpolicy.rollout.gate_registry import gate_outcomes
from kvpolicy.rollout.gates import JOB_GATES
from kvpolicy.rollout.rules import phase_deadline
from kvpolicy.rollout.step import step
from kvpolicy.rollout.step_types import Event, Observations, StepConfig, StepResult
from kvpolicy.rollout.targets import target_kind
from kvpolicy.rollout.traffic_routes import restore_actions
from kvpolicy.runtime.pass_slots import PassSlots

logger = logging.getLogger(__name__)
Obj = dict[str, Any]
MAX_MESSAGE = 1024
# How long a stopped loop may finish its pass before it is cancelled (kopf's daemons had the same).
STOP_SECONDS = 10.0
# A policy at rest when its loop starts (a restart, a new leader) has its first look spread over this long, or over
# the idle period if shorter, as client-go spreads its resyncs: thousands of drift checks at once would hold up the
# rollouts in flight and the new or edited policies, whose passes go first (issue 28 item 5).
AT_REST_SPREAD_SECONDS = 30.0
# Holds a policy's deletion until its loop has removed its children and said what the target runs (the name kopf
# used when it ran the deletion, so that policies made by earlier versions are finalized the same way).
FINALIZER = f"{GROUP}/finalizer"


def invalid_spec_message(error: ValidationError) -> str:
    """Every field error of an invalid KVPolicy, `field.path: what is wrong`, joined."""
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"])
        text = str(problem["msg"]).removeprefix("Value error, ")
        problems.append(f"{where}: {text}" if where else text)
    return f"invalid KVPolicy: {'; '.join(problems)}"[:MAX_MESSAGE]


def _conditions(raw: Obj) -> list[Condition]:
    """The stored conditions that still parse (an invalid policy's status is read as leniently as it can be)."""
    parsed = []
    for item in (raw.get("status") or {}).get("conditions") or []:
        try:
            parsed.append(Condition.model_validate(item))
        except ValidationError:
            continue
    return parsed


class StopFlag(Protocol):
    """Truthy once a policy's loop must end (checked before each pass); who sets it wakes the loop too."""

    def __bool__(self) -> bool: ...


@dataclass
class LoopStop:
    """The stop flag of a loop `Reconciler.start` runs; `Reconciler.stop` sets it."""

    stopped: bool = False

    def __bool__(self) -> bool:
        return self.stopped


def policy_info(spec: KVPolicySpec, status: KVPolicyStatus) -> metrics.PolicyInfo:
    """What kvpolicy_policy_info says about a policy after a pass."""
    plan, gpu, decision = status.plan, status.gpu, status.decision
    return metrics.PolicyInfo(
        phase=status.phase or Phase.PLANNING,
        kv_cache=plan.kv_cache_dtype if plan else "",
        gpu=(gpu.product or gpu.generation) if gpu else "",
        target=f"{spec.target_ref.kind}/{spec.target_ref.name}",
        decision=decision.result if decision else "",
        reason=decision.reason if decision else "",
    )


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class Reconciler:
    api: KubeApi
    config: StepConfig
    analyser: LatencyAnalyser | None = None
    clock: Callable[[], datetime] = _utcnow
    notifier: Notifier | None = None
    max_backoff_seconds: float = 60.0
    read_inference_pools: bool = False  # the ReplicaRatio skew check (observe.py); needs list on inferencepools
    _wake: dict[str, asyncio.Event] = field(default_factory=dict, init=False)
    _generations: dict[str, int] = field(default_factory=dict, init=False)
    _phases: dict[str, str] = field(default_factory=dict, init=False)
    # How many policies are in each phase, kept with `_phases`: counting all of them on every pass cost N per pass.
    _phase_counts: Counter[str] = field(default_factory=Counter, init=False)
    # The policy as the API server returned it to this loop's last status write: the next pass starts from it
    # instead of reading the policy again, unless a watch event says the spec changed (or a write failed). Kept only
    # for policies looked at again within the idle period (rollouts in flight): one at rest is read again at its
    # next pass, a GET per idle period rather than a whole policy in memory for each of thousands (issue 28).
    _known: dict[str, Obj] = field(default_factory=dict, init=False)
    # Policies waiting for the one that governs their target to be deleted: (namespace, its name) -> their uids.
    _waiting: dict[tuple[str, str], set[str]] = field(default_factory=dict, init=False)
    # Loops sleeping out a retryable API failure: `wake_backing_off` wakes them when the API server answers again.
    _backing_off: set[str] = field(default_factory=set, init=False)
    # Loops woken by a spec change or a deletion since their last pass: their next pass is urgent (pass_slots.py).
    _changed: set[str] = field(default_factory=set, init=False)
    # The policies' loops `start` runs, by uid: a task each, rather than a kopf daemon each, whose machinery (a stop
    # flag with a thread event, a logger, the handler's kwargs, the latest body kept for it) cost more memory than
    # the loop itself (issue 28).
    _loops: dict[str, tuple[asyncio.Task[None], LoopStop]] = field(default_factory=dict, init=False)
    # Passes in flight at once. The client has this many connections: thousands of passes started together (a
    # restart, a batch of new policies) would otherwise all hold their policy, observations and step result while
    # queued for one, and all finish late rather than in turn (issue 28).
    # Urgent passes (new, edited, in flight) before those of policies at rest (pass_slots.py).
    _passes: PassSlots = field(default_factory=lambda: PassSlots(REQUEST_CONNECTIONS), init=False)

    @property
    def observer(self) -> Observer:
        return Observer(self.api, self.analyser, self.read_inference_pools)

    # ----------------------------------------------------------------------------------------------------- waking

    def notice(self, uid: str, generation: int | None, deleting: bool) -> None:
        """A watch event for a policy: wake its loop early when the spec changed or it is being deleted."""
        seen = self._generations.get(uid)
        if deleting or (generation is not None and seen is not None and generation != seen):
            # What the loop last wrote is no longer the whole truth: read the policy again.
            self._known.pop(uid, None)
            if uid in self._loops:
                self._changed.add(uid)
            self._wake_up(uid)

    def released(self, namespace: str, name: str) -> None:
        """A policy is gone: wake the loops of the policies that waited for its target."""
        for uid in self._waiting.pop((namespace, name), set()):
            self._known.pop(uid, None)
            self._wake_up(uid)

    def wake_backing_off(self) -> None:
        """The API server answers again (supervisor.py's probe): loops backing off after an API failure look again
        now rather than at the end of their backoff (up to a minute)."""
        for uid in self._backing_off:
            self._wake_up(uid)

    def _wake_up(self, uid: str) -> None:
        """End the loop's sleep, or its next one when it is in a pass. Only a running loop has an event to set: one
        made for a policy whose loop has ended (its DELETED event comes after) would stay for the process's life."""
        event = self._wake.get(uid)
        if event is not None:
            event.set()

    async def _sleep(self, uid: str, delay: float) -> None:
        event = self._wake.setdefault(uid, asyncio.Event())
        if not event.is_set() and delay > 0:
            # A timer on the one event rather than a task per thing to wait for: thousands of loops sleep at once.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await event.wait()
        event.clear()

    # ----------------------------------------------------------------------------------------------------- loops

    def start(self, namespace: str, name: str, uid: str, seen: Obj | None = None) -> None:
        """Run the policy's loop in a task of its own, unless it runs already (called for each watch event of a
        policy that is not being deleted: the first one starts it). `seen`: the policy as the event brought it, which
        the first pass starts from instead of reading it again (a GET per policy when thousands start at once)."""
        if uid in self._loops:
            return
        if seen is not None:
            self._known[uid] = seen
        stop = LoopStop()
        task = asyncio.create_task(self.run_policy(namespace, name, uid, stop), name=f"policy {namespace}/{name}")
        self._loops[uid] = (task, stop)

        def ended(_: asyncio.Task[None]) -> None:
            if self._loops.get(uid, (None, None))[0] is task:
                del self._loops[uid]

        task.add_done_callback(ended)

    def running(self, uid: str) -> bool:
        return uid in self._loops

    async def stop(self, uid: str, timeout_seconds: float = STOP_SECONDS) -> None:
        """End the policy's loop and wait for it (after its pass in flight, cancelled after `timeout_seconds`), so
        that nothing it does overlaps what comes next: the operator's exit, or the next leader's passes."""
        running = self._loops.get(uid)
        if running is None:
            return
        task, stop = running
        stop.stopped = True
        self._wake_up(uid)
        done, _ = await asyncio.wait({task}, timeout=timeout_seconds)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop_all(self, timeout_seconds: float = STOP_SECONDS) -> None:
        await asyncio.gather(*(self.stop(uid, timeout_seconds) for uid in list(self._loops)))

    # ------------------------------------------------------------------------------------------------------ loop

    async def run_policy(self, namespace: str, name: str, uid: str, stopped: StopFlag) -> None:
        failures = 0
        self._wake.setdefault(uid, asyncio.Event())  # a wake-up during the first pass ends the first sleep
        try:
            if not self._urgent(uid):
                await self._first_look_later(uid)
            while not stopped:
                try:
                    async with self._passes.slot(urgent=self._urgent(uid)):
                        self._changed.discard(uid)
                        delay = await self.reconcile_once(namespace, name, uid)
                    failures = 0
                    self._backing_off.discard(uid)
                except ApiError as error:
                    # Reading the policy or writing its status failed, so no condition can say it: the metric, the
                    # log and (once per run of failures that will not pass) an event do.
                    self._known.pop(uid, None)
                    if error.retryable:
                        self._backing_off.add(uid)
                    failures += 1
                    delay = self._backoff(failures) if error.retryable else self.max_backoff_seconds
                    metrics.record_reconcile_error(error.reason or str(error.code))
                    logger.warning("%s/%s: %s; retrying in %.1f s", namespace, name, error, delay)
                    if not error.retryable and failures == 1:
                        about = {"metadata": {"namespace": namespace, "name": name, "uid": uid}}
                        refused = Event("Warning", Reason.API_REQUEST_REJECTED, str(error))
                        await post_events(self.api, {**self._identity(), **about}, [refused], self.clock())
                except Exception:
                    # A bug must not end the policy's loop for good: say so loudly and try again later.
                    self._known.pop(uid, None)
                    failures += 1
                    delay = self._backoff(failures)
                    metrics.record_reconcile_error("Unexpected")
                    logger.exception("%s/%s: unexpected error; retrying in %.1f s", namespace, name, delay)
                if delay is None:
                    return
                await self._sleep(uid, delay)
        finally:
            self._wake.pop(uid, None)
            self._generations.pop(uid, None)
            self._known.pop(uid, None)
            self._backing_off.discard(uid)
            self._changed.discard(uid)
            # A policy that waited for another's target and is gone before it: nothing is left to wake.
            for governor, waiting in list(self._waiting.items()):
                waiting.discard(uid)
                if not waiting:
                    del self._waiting[governor]

    async def _first_look_later(self, uid: str) -> None:
        """Wait out a policy at rest's share of the spread (the same for a uid each time), unless a spec change or
        a deletion wakes it first. What its event brought is not kept meanwhile: its pass reads it again."""
        seen = self._known.pop(uid, None)
        if seen is not None:  # counted in its phase at once, not only after its first pass
            self._set_phase(uid, (seen.get("status") or {}).get("phase") or Phase.PLANNING)
            metrics.set_policies_by_phase(self._phase_counts)
        share = int(hashlib.sha256(uid.encode()).hexdigest()[:8], 16) / 0x1_0000_0000
        await self._sleep(uid, share * min(AT_REST_SPREAD_SECONDS, self.config.idle_seconds))

    def _urgent(self, uid: str) -> bool:
        """Whether the policy's next pass may have something to do at once: all but a policy at rest (decided, its
        spec handled), known from the body its loop holds (the watch event's, at the first pass) or its last pass."""
        known = self._known.get(uid)
        if known is not None:
            meta, status = known["metadata"], known.get("status") or {}
            handled = status.get("observedGeneration") == meta.get("generation")
            return bool(meta.get("deletionTimestamp")) or not handled or status.get("phase") not in TERMINAL_PHASES
        return uid in self._changed or self._phases.get(uid) not in TERMINAL_PHASES

    @staticmethod
    def _identity() -> Obj:
        return {"apiVersion": API_VERSION, "kind": KIND}

    def _backoff(self, failures: int) -> float:
        return min(self.max_backoff_seconds, self.config.poll_seconds * 2.0 ** min(failures, 10) / 4)

    async def reconcile_once(self, namespace: str, name: str, uid: str | None = None) -> float | None:
        """One pass; the seconds until the next one, or None when the policy is gone or its deletion is done."""
        raw = self._known.pop(uid, None) if uid else None
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            raw = await self.api.get(KVPOLICIES, namespace, name)  # a deletion acts on what is stored now
        if raw is None:
            return None
        if raw["metadata"].get("deletionTimestamp"):
            await self.finalize(raw)
            return None
        if FINALIZER not in (raw["metadata"].get("finalizers") or []):
            raw = await self._hold_deletion(raw)
            if raw is None:
                return None
        uid = raw["metadata"]["uid"]
        self._generations[uid] = int(raw["metadata"].get("generation") or 1)
        try:
            policy = KVPolicy.model_validate(raw)
        except ValidationError as error:
            # The API server's schema should have refused it (or was tightened since it was stored): say what is
            # wrong, count it for the alert, and wait for a fix.
            metrics.record_reconcile_error(Reason.INVALID_SPEC)
            await self._not_ready(raw, Reason.INVALID_SPEC, invalid_spec_message(error))
            return self.config.idle_seconds
        now = self.clock()
        try:
            observations = await self.observer.observe(policy, now)
            result = step(policy, observations, self.config)
            rejected = await apply_actions(self.api, namespace, result.actions)
        except ApiError as error:
            if error.retryable:
                raise
            metrics.record_reconcile_error(error.reason or str(error.code))
            await self._not_ready(raw, Reason.API_REQUEST_REJECTED, f"the API server refused a request: {error}")
            return self.max_backoff_seconds
        for refused in rejected:
            metrics.record_reconcile_error(refused.error.reason or str(refused.error.code))
        events = list(result.events)
        readiness = self._readiness(policy, result, observations, rejected)
        if readiness is not None:
            events.append(readiness)
        status = result.status.to_k8s()
        written = await write_status(self.api, raw, status)
        if written is None:
            return None
        if result.requeue_after < self.config.idle_seconds:
            self._known[uid] = written
        await post_events(self.api, raw, events, now)
        if self.notifier is not None:
            self.notifier.submit(policy, result.notices)  # queued: a slow or dead receiver never holds the loop
        self._record_metrics(policy, observations, result)
        if observations.governed_by is not None:
            self._waiting.setdefault((namespace, observations.governed_by), set()).add(uid)
        if rejected:
            # Trying the same request again at once cannot help; the deadlines still fire at the step's pace.
            return max(result.requeue_after, self.config.poll_seconds)
        return result.requeue_after

    def _readiness(
        self, policy: KVPolicy, result: StepResult, observations: Observations, rejected: list[Rejected]
    ) -> Event | None:
        """Set the Ready condition after a pass; a Warning event when it turned False or its reason changed. A target
        governed by another policy is the step's to say (Conflict)."""
        if observations.governed_by is not None:
            return None
        conditions, generation = result.status.conditions, int(policy.metadata.get("generation") or 1)
        now = observations.now
        if not rejected:
            set_condition(conditions, ConditionType.READY, ConditionStatus.TRUE, Reason.RECONCILED, "", now, generation)
            return None
        message = "; ".join(refused.describe() for refused in rejected)[:MAX_MESSAGE]
        reason, status = Reason.API_REQUEST_REJECTED, ConditionStatus.FALSE
        previous = set_condition(conditions, ConditionType.READY, status, reason, message, now, generation)
        if previous is not None and (previous.status, previous.reason, previous.message) == (status, reason, message):
            return None
        return Event("Warning", reason, message)

    async def _not_ready(self, raw: Obj, reason: Reason, message: str) -> None:
        """Say in the Ready condition why the operator cannot act on the policy (a Warning event when that is news)
        without reading the rest of its status, which may not parse either."""
        conditions = _conditions(raw)
        generation = int(raw["metadata"].get("generation") or 1)
        now = self.clock()
        status = ConditionStatus.FALSE
        previous = set_condition(conditions, ConditionType.READY, status, reason, message, now, generation)
        if previous is None or (previous.status, previous.reason, previous.message) != (status, reason, message):
            await post_events(self.api, raw, [Event("Warning", reason, message)], now)
        else:
            logger.warning("%s/%s %s: %s", raw["metadata"]["namespace"], raw["metadata"]["name"], reason, message)
        status_obj = {**(raw.get("status") or {}), "conditions": [c.to_k8s() for c in conditions]}
        await write_status(self.api, raw, status_obj)  # what it returns is not kept: the next pass is not soon

    def _set_phase(self, uid: str, phase: str | None) -> None:
        """Keep `_phases` and `_phase_counts` together; None: the policy is gone."""
        before = self._phases.pop(uid, None)
        if before is not None:
            self._phase_counts[before] -= 1
            if not self._phase_counts[before]:
                del self._phase_counts[before]
        if phase is not None:
            self._phases[uid] = phase
            self._phase_counts[phase] += 1

    def _record_metrics(self, policy: KVPolicy, observations: Observations, result: StepResult) -> None:
        namespace, name = str(policy.metadata["namespace"]), str(policy.metadata["name"])
        before, after = policy.status, result.status
        uid = str(policy.metadata.get("uid"))
        self._set_phase(uid, after.phase or Phase.PLANNING)
        metrics.set_policies_by_phase(self._phase_counts)
        if after.decision is not None and after.decision != before.decision:
            metrics.record_decision(after.decision.result, after.decision.reason, namespace, name)
            started = after.rollout_started_at
            if started is not None:
                elapsed = (observations.now - started).total_seconds()
                metrics.observe_rollout_duration(elapsed, after.decision.result)
        for outcome in gate_outcomes(policy, after, observations.checks):
            record = outcome.record
            if record is None:
                metrics.count_gate_result(outcome.gate, outcome.verdict)
            else:
                metrics.record_gate_result(
                    name,
                    namespace,
                    outcome.gate,
                    outcome.verdict,
                    record.recovery,
                    record.canary_score,
                    record.baseline_score,
                    outcome.min_recovery,
                )
        for gate in JOB_GATES:
            if gate.result(after) is None:
                metrics.clear_gate(namespace, name, gate.name)
        metrics.set_policy_info(namespace, name, policy_info(policy.spec, after))
        # A side's pods are known only in passes that observed them: keep the last known until the canary is gone.
        for role, pods in ((b.ROLE_CANARY, observations.canary_pods), (b.ROLE_BASELINE, observations.baseline_pods)):
            if after.canary is None or pods:
                metrics.set_rollout_pods(namespace, name, role, [] if after.canary is None else [p.name for p in pods])
        updated = policy.model_copy(update={"status": after})
        deadline = phase_deadline(updated)
        metrics.set_phase_deadline(namespace, name, after.phase or "", deadline.timestamp() if deadline else None)
        share = after.traffic_share if after.phase == Phase.LATENCY_ANALYSIS else None
        metrics.set_traffic_share(
            namespace,
            name,
            share.intended_percent / 100 if share else None,
            share.measured_percent / 100 if share and share.measured_percent is not None else None,
        )
        analysed = observations.analysis_verdict()
        if analysed is not None:
            metrics.record_analysis(namespace, name, analysed)
        elif after.phase != Phase.LATENCY_ANALYSIS and before.phase == Phase.LATENCY_ANALYSIS:
            metrics.clear_analysis(namespace, name)

    # -------------------------------------------------------------------------------------------------- deletion

    async def _hold_deletion(self, raw: Obj) -> Obj | None:
        """Add the finalizer before the pass can make any child. The resourceVersion makes the merge patch fail
        (409, retried) rather than drop a finalizer another controller added meanwhile; None: the policy is gone."""
        meta = raw["metadata"]
        finalizers = [*(meta.get("finalizers") or []), FINALIZER]
        patch = {"metadata": {"finalizers": finalizers, "resourceVersion": meta.get("resourceVersion")}}
        return await self.api.patch(KVPOLICIES, meta["namespace"], meta["name"], patch)

    async def finalize(self, raw: Obj) -> None:
        """A policy being deleted: remove its children, say what the target is left running (a `Deleted` event),
        then release the deletion. A refusal that will not pass (403, 422, ...) is said in a Warning event and does
        not hold the deletion for ever (ownerReferences still remove the children); a failure that may pass is
        raised, and the loop tries again after its backoff."""
        meta = raw["metadata"]
        finalizers = meta.get("finalizers") or []
        if FINALIZER not in finalizers:
            return
        events: list[Event]
        try:
            stated = await self.cleanup(raw)
            events = [Event("Normal", Reason.DELETED, f"children removed; {stated}")]
        except ApiError as error:
            if error.retryable:
                raise
            message = f"the API server refused a request of the deletion's cleanup: {error}"[:MAX_MESSAGE]
            events = [Event("Warning", Reason.API_REQUEST_REJECTED, message)]
        await post_events(self.api, raw, events, self.clock())
        kept = [finalizer for finalizer in finalizers if finalizer != FINALIZER]
        patch = {"metadata": {"finalizers": kept, "resourceVersion": meta.get("resourceVersion")}}
        await self.api.patch(KVPOLICIES, meta["namespace"], meta["name"], patch)

    async def cleanup(self, raw: Obj) -> str:
        """Remove the policy's children; finish restoring the target if a rollback was under way. Returns what the
        target is left running, for the event and the log. Nothing here needs a valid spec: an invalid policy (after
        an upgrade that tightened the schema) must still be deletable."""
        meta = raw["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], str(meta.get("uid"))
        selector = label_selector(b.policy_labels(name))
        target_ref, status = _stored_target_ref(raw), _stored_status(raw)
        if status.traffic is not None:  # the route first (no one may be sent to a canary being removed), its pool next
            route, pools = await traffic_objects(self.api, namespace, status.traffic.route)
            actions, _ = restore_actions(status, Observations(now=self.clock(), route=route, pools=pools))
            await apply_actions(self.api, namespace, actions)
        # The canary is of the target's kind; a spec too broken to name one has had no canary made from it.
        kinds = [resource_for(target_kind(target_ref).object_kind)] if target_ref is not None else []
        for resource in (*kinds, SERVICES, JOBS):
            for child in await self.api.list_objects(resource, namespace, selector):
                if any(ref.get("uid") == uid for ref in child["metadata"].get("ownerReferences") or []):
                    await self.api.delete(resource, namespace, child["metadata"]["name"])
        self._set_phase(uid, None)
        metrics.set_policies_by_phase(self._phase_counts)
        metrics.forget_policy(namespace, name)
        if target_ref is None:
            return "its spec names no readable targetRef, so no target was touched"
        kind = target_kind(target_ref)
        target = await self.api.get(resource_for(kind.object_kind), namespace, target_ref.name)
        if target is None:
            return f"target {target_ref.kind.value} {target_ref.name} does not exist"
        previous = status.previous_template
        try:
            current: PodTemplateRecord = kind.record(target, target_ref.container)
        except b.TargetShapeError as error:
            return f"{target_ref.name} left as it is: {error}"
        if status.phase == Phase.ROLLING_BACK and previous is not None:
            patch = kind.patch(target, target_ref.container, previous)
            await self.api.patch(resource_for(kind.object_kind), namespace, target["metadata"]["name"], patch, "json")
            return f"{target_ref.name} restored to its recorded BF16 configuration (image {previous.image})"
        dtype = "FP8" if b.runs_fp8(current) else "BF16"
        return f"{target_ref.name} left as it runs: {dtype} KV cache, image {current.image}"


def _stored_target_ref(raw: Obj) -> TargetRef | None:
    try:
        return TargetRef.model_validate((raw.get("spec") or {}).get("targetRef"))
    except ValidationError:
        return None


def _stored_status(raw: Obj) -> KVPolicyStatus:
    try:
        return KVPolicyStatus.model_validate(raw.get("status") or {})
    except ValidationError:
        return KVPolicyStatus()


async def close(reconciler: Reconciler) -> None:
    if reconciler.analyser is not None:
        with contextlib.suppress(Exception):
            await reconciler.analyser.close()
