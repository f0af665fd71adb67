"""Observe what one step of a KVPolicy needs, and nothing more: each phase reads only the objects it looks at."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvpolicy.analysis.checks import AnyCheck, CheckVerdict, Sides
from kvpolicy.analysis.model import ProviderUnavailableError, SideSelector, Verdict
from kvpolicy.analysis.prometheus import DEFAULT_SELECTOR_TEMPLATE, PrometheusProvider
from kvpolicy.analysis.provider import MetricsProvider
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.api.v1alpha1 import (
    TERMINAL_PHASES,
    EndpointPicker,
    GpuFacts,
    KVPolicy,
    LatencyProvider,
    Phase,
    Traffic,
)
from kvpolicy.credentials import Credentials
from kvpolicy.kube.api import (
    DEPLOYMENTS,
    HTTP_ROUTES,
    INFERENCE_POOLS,
    JOBS,
    KVPOLICIES,
    NODES,
    PODS,
    SERVICES,
    ApiError,
    FieldEquals,
    KubeApi,
    label_selector,
)
from kvpolicy.kube.executor import resource_for
from kvpolicy.kube.references import ReferenceReader, prometheus_credentials
from kvpolicy.planning.gpu import PRESENT_LABEL, gpu_facts, required_affinity_admits
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.conditions import object_condition
from kvpolicy.rollout.gates import PHASE_GATES
from kvpolicy.rollout.metric_checks import check_due, checks_for, needs_baseline
from kvpolicy.rollout.ownership import TARGET_NAME_PATH, governing_policy
from kvpolicy.rollout.rules import analysis_window_seconds, rollout_hash
from kvpolicy.rollout.step_types import JobView, Observations, PodView
from kvpolicy.rollout.targets import target_kind
from kvpolicy.rollout.tick import REPLAN_PHASES

Obj = dict[str, Any]
GPU_PRESENT = {PRESENT_LABEL: "true"}
JOB_NAME_LABEL = "job-name"
# The scheduler's PodScheduled reason for a pod it cannot place (Kubernetes', not one of ours).
POD_UNSCHEDULABLE = "Unschedulable"
# The kubelet's waiting reasons of a container that will not start without someone's help.
START_FAILURES = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)
# What each phase's step looks at beyond the target (fewer requests per pass: 1,000 policies poll one API server).
PHASE_NEEDS: dict[Phase, frozenset[str]] = {
    Phase.CANARY_STARTING: frozenset({"canary", "pods", "services"}),
    **{gate.phase: frozenset({"jobs"}) for gate in PHASE_GATES},
    Phase.LATENCY_ANALYSIS: frozenset({"canary", "pods", "jobs"}),
    # The background analysis reads the canary's pods while a joined canary waits for its approval.
    Phase.AWAITING_APPROVAL: frozenset({"canary", "pods"}),
    Phase.PROMOTING: frozenset({"canary", "services"}),
    Phase.ROLLING_BACK: frozenset({"canary", "services", "jobs"}),
}


def pod_view(pod: Mapping[str, Any]) -> PodView:
    ready = object_condition(pod, "Ready")
    scheduled = object_condition(pod, "PodScheduled")
    unschedulable = None
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == POD_UNSCHEDULABLE:
        unschedulable = str(scheduled.get("message") or POD_UNSCHEDULABLE)
    return PodView(
        name=pod["metadata"]["name"],
        ip=(pod.get("status") or {}).get("podIP"),
        ready=bool(ready and ready.get("status") == "True"),
        unschedulable=unschedulable,
        labels=dict(pod["metadata"].get("labels") or {}),
    )


def not_starting(pod: Mapping[str, Any]) -> str | None:
    """Why a pod cannot start, in the scheduler's or the kubelet's words; None when nothing stops it."""
    name = pod["metadata"]["name"]
    unschedulable = pod_view(pod).unschedulable
    if unschedulable is not None:
        return f"pod {name} is {POD_UNSCHEDULABLE}: {unschedulable}"
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in START_FAILURES:
            return f"pod {name} is {waiting['reason']}: {waiting.get('message') or 'no message'}"
    return None


def job_view(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> JobView:
    """A Job's outcome: its conditions, and how its latest finished pod ended (exit code, reason, termination
    message); while it runs, why its pod cannot start, if it cannot."""
    complete, failed = object_condition(job, "Complete"), object_condition(job, "Failed")
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    finished_at = ""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated")
            if terminated and str(terminated.get("finishedAt") or "") >= finished_at:
                finished_at = str(terminated.get("finishedAt") or "")
                exit_code = terminated.get("exitCode")
                reason = terminated.get("reason")
                message = terminated.get("message")
    running = not _finished(job)
    waiting = [pod for pod in pods if running and not pod["metadata"].get("deletionTimestamp")]
    stuck = [why for pod in waiting if (why := not_starting(pod)) is not None]
    return JobView(
        name=job["metadata"]["name"],
        succeeded=bool(complete and complete.get("status") == "True"),
        failed=bool(failed and failed.get("status") == "True"),
        failure_reason=str(failed.get("reason")) if failed and failed.get("status") == "True" else None,
        exit_code=exit_code,
        terminated_reason=reason,
        termination_message=message,
        not_starting=stuck[0] if stuck else None,
    )


def _finished(job: Mapping[str, Any]) -> bool:
    return any((object_condition(job, type_) or {}).get("status") == "True" for type_ in ("Complete", "Failed"))


def live(objects: Sequence[Obj]) -> list[Obj]:
    return [obj for obj in objects if not obj["metadata"].get("deletionTimestamp")]


def gpu_node_selector(policy: KVPolicy, target: Mapping[str, Any]) -> dict[str, str]:
    if policy.spec.gpu_node_selector:
        return dict(policy.spec.gpu_node_selector)
    selector = target_kind(policy.spec.target_ref).pod_spec(target).get("nodeSelector")
    return dict(selector) if selector else dict(GPU_PRESENT)


def pool_gpu_facts(policy: KVPolicy, target: Mapping[str, Any], nodes: Sequence[Obj]) -> GpuFacts:
    """GPU facts of the nodes the target's pods may land on, among those its selector listed: a target placed by
    required node affinity (Karpenter, GKE and EKS node pools) is held to it too, unless spec.gpuNodeSelector names
    the pool."""
    pod_spec = target_kind(policy.spec.target_ref).pod_spec(target)
    affinity = None if policy.spec.gpu_node_selector else pod_spec.get("affinity")
    return gpu_facts(
        [
            node["metadata"].get("labels") or {}
            for node in nodes
            if required_affinity_admits(node["metadata"]["name"], node["metadata"].get("labels") or {}, affinity)
        ]
    )


@dataclass
class LatencyAnalyser:
    """Evaluates the metrics checks (metric_checks.py) of a canary against the target's own pods, through the
    configured provider.

    Prometheus providers are kept per URL and selector template, and per policy where `prometheusAuth` gives
    credentials: a rotated Secret (seen through `references`, within its TTL) replaces the policy's provider.
    Credentials that cannot be read are a ProviderUnavailableError, like any provider that cannot answer."""

    scrape: ScrapeProvider = field(default_factory=ScrapeProvider)
    references: ReferenceReader | None = None  # None: policies with prometheusAuth get ProviderUnavailable
    _prometheus: dict[str, tuple[str, PrometheusProvider]] = field(default_factory=dict)

    async def provider(self, policy: KVPolicy) -> MetricsProvider:
        latency = policy.spec.gates.latency
        if latency.provider != LatencyProvider.PROMETHEUS or not latency.prometheus_url:
            return self.scrape
        analysis = policy.spec.analysis
        template = (analysis.selector_template if analysis else None) or DEFAULT_SELECTOR_TEMPLATE
        url, auth = latency.prometheus_url, latency.prometheus_auth
        if auth is None:
            return await self._prometheus_for(f"{url} {template}", url, template, "", None)
        if self.references is None:
            raise ProviderUnavailableError(
                AnalysisReason.CREDENTIALS_SECRET_UNREADABLE, "this operator reads no Secrets for prometheusAuth"
            )
        namespace = str(policy.metadata.get("namespace", ""))
        resolved = await prometheus_credentials(self.references, namespace, auth)
        key = f"{namespace}/{policy.metadata.get('name', '')} {url} {template}"
        return await self._prometheus_for(key, url, template, resolved.digest, resolved.credentials)

    async def _prometheus_for(
        self, key: str, url: str, template: str, digest: str, credentials: Credentials | None
    ) -> PrometheusProvider:
        kept = self._prometheus.get(key)
        if kept is not None and kept[0] == digest:
            return kept[1]
        if kept is not None:  # rotated credentials: a new session with the new TLS context and headers
            await kept[1].close()
        provider = PrometheusProvider(url, credentials=credentials, selector_template=template)
        self._prometheus[key] = (digest, provider)
        return provider

    @staticmethod
    def side(policy: KVPolicy, target: Mapping[str, Any], role: str, pods: Sequence[PodView]) -> SideSelector:
        port = target_kind(policy.spec.target_ref).serving_port(target, policy.spec.target_ref.container)
        ready = [pod for pod in pods if pod.ready and pod.ip]
        return SideSelector(
            role=role,
            namespace=str(policy.metadata.get("namespace", "")),
            pods=tuple(pod.name for pod in ready),
            labels=dict(ready[0].labels) if ready else {},
            endpoints=tuple(f"http://{pod.ip}:{port}" for pod in ready),
        )

    async def evaluate(
        self,
        policy: KVPolicy,
        target: Mapping[str, Any],
        checks: Sequence[AnyCheck],
        canary: Sequence[PodView],
        baseline: Sequence[PodView],
        window_seconds: int,
    ) -> tuple[CheckVerdict, ...]:
        """Each check's verdict over the last `window_seconds`, in order; an unavailable provider is a verdict, never
        an exception."""
        try:
            provider = await self.provider(policy)
        except ProviderUnavailableError as error:
            unavailable = Verdict.provider_unavailable(error)
            return tuple(CheckVerdict(check, unavailable) for check in checks)
        sides = Sides(
            self.side(policy, target, "canary", canary), self.side(policy, target, "baseline", baseline), window_seconds
        )
        return tuple([CheckVerdict(check, await check.evaluate(provider, policy, sides)) for check in checks])

    async def close(self) -> None:
        await self.scrape.close()
        for _, provider in self._prometheus.values():
            await provider.close()


async def traffic_objects(api: KubeApi, namespace: str, route: str) -> tuple[Obj | None, dict[str, Obj]]:
    """The HTTPRoute named `route` (None: not found) and the namespace's InferencePools by name."""
    found = await api.get(HTTP_ROUTES, namespace, route) if route else None
    try:
        listed = await api.list_objects(INFERENCE_POOLS, namespace)
    except ApiError as error:
        if error.code != 404:  # 404: the InferencePool CRD is not installed: there are none
            raise
        listed = []
    return found, {pool["metadata"]["name"]: pool for pool in live(listed)}


@dataclass
class Observer:
    api: KubeApi
    analyser: LatencyAnalyser | None = None
    # ReplicaRatio: look for an InferencePool selecting the target (an optional read the operator may not be granted).
    read_inference_pools: bool = False

    async def observe(self, policy: KVPolicy, now: datetime) -> Observations:
        status = policy.status
        namespace = str(policy.metadata.get("namespace", ""))
        name = str(policy.metadata.get("name", ""))
        restarting = status.spec_hash != rollout_hash(policy.spec)
        phase = Phase.PLANNING if restarting or status.phase is None else status.phase
        # Before a rollout's first write, ownership is read from a list holding every write made before this
        # policy's spec: a cache a moment behind could miss a policy created at the same time for the same target.
        since = {"metadata": policy.metadata} if phase == Phase.PLANNING else None
        target_name = policy.spec.target_ref.name
        claims = FieldEquals(TARGET_NAME_PATH, target_name)
        peers = await self.api.list_objects(KVPOLICIES, namespace, since=since, where=claims)
        governed_by = governing_policy(policy.metadata, target_name, peers)
        if governed_by is not None:  # nothing else matters until that policy is gone, but a route of ours to restore
            route, pools, pickers = await self._traffic_objects(policy, phase)
            return Observations(now=now, governed_by=governed_by, route=route, pools=pools, pickers=pickers)
        if phase == Phase.ROLLED_BACK:
            return Observations(now=now)
        kind = target_kind(policy.spec.target_ref)
        target = await self.api.get(resource_for(kind.object_kind), namespace, policy.spec.target_ref.name)
        gpu = None
        if target is not None and (phase == Phase.PLANNING or phase in REPLAN_PHASES):
            listed = await self.api.list_objects(NODES, None, label_selector(gpu_node_selector(policy, target)))
            gpu = pool_gpu_facts(policy, target, listed)
        route, pools, pickers = await self._traffic_objects(policy, phase)
        if phase == Phase.PLANNING or phase in TERMINAL_PHASES:  # decided: the target's drift; HeldBF16: the GPUs too
            return Observations(now=now, target=target, gpu=gpu, route=route, pools=pools, pickers=pickers)

        needs = PHASE_NEEDS.get(phase, frozenset())
        by_policy = label_selector(b.policy_labels(name))
        canary = None
        if "canary" in needs and status.canary is not None:
            canary = await self.api.get(resource_for(kind.object_kind), namespace, status.canary.deployment)
        # The canary's pods, and the gate Jobs' (their termination messages, or why they cannot start).
        all_pods = await self.api.list_objects(PODS, namespace, by_policy) if needs & {"pods", "jobs"} else []
        pods = live(all_pods) if "pods" in needs else []
        # Of the canary's pods, those that serve (a multi-node LLMInferenceService's workers carry its labels too).
        serving = kind.serving_labels(target) if target is not None else {}
        canary_pods = tuple(
            pod_view(pod)
            for pod in pods
            if b.CANARY_LABEL in (labels := pod["metadata"].get("labels") or {})
            and all(labels.get(key) == value for key, value in serving.items())
        )
        services: frozenset[str] = frozenset()
        if "services" in needs:
            services_found = live(await self.api.list_objects(SERVICES, namespace, by_policy))
            services = frozenset(service["metadata"]["name"] for service in services_found)
        jobs = {}
        for job in await self.api.list_objects(JOBS, namespace, by_policy) if "jobs" in needs else []:
            job_name = job["metadata"]["name"]
            job_pods = [pod for pod in all_pods if pod["metadata"].get("labels", {}).get(JOB_NAME_LABEL) == job_name]
            jobs[job_name] = job_view(job, job_pods)
        checks, baseline_pods = await self._checks(policy, target, canary_pods, now) if target is not None else ((), ())
        return Observations(
            now=now,
            target=target,
            gpu=gpu,
            checks=checks,
            canary=next(iter(live([canary] if canary else [])), None),
            canary_pods=canary_pods,
            baseline_pods=baseline_pods,
            services=services,
            jobs=jobs,
            route=route,
            pools=pools,
            pickers=pickers,
        )

    async def _traffic_objects(
        self, policy: KVPolicy, phase: Phase
    ) -> tuple[Obj | None, dict[str, Obj], dict[str, Obj]]:
        """traffic InferencePool: the route and the namespace's InferencePools, while the rollout shifts the route or
        has an edit of it to put back (in any phase: a restart puts it back before anything else), and with
        endpointPicker CopyBaseline the namespace's Services and Deployments (the baseline's EPP and its copy).
        ReplicaRatio: the pools, while planning (one that selects the target's pods skews the canary's share)."""
        routing = policy.spec.rollout.inference_pool
        traffic = policy.spec.rollout.traffic
        shifting = traffic == Traffic.INFERENCE_POOL and phase == Phase.LATENCY_ANALYSIS
        skew_check = self.read_inference_pools and traffic == Traffic.REPLICA_RATIO and phase == Phase.PLANNING
        recorded = policy.status.traffic
        if not shifting and not skew_check and recorded is None:
            return None, {}, {}
        namespace = str(policy.metadata.get("namespace", ""))
        name = recorded.route if recorded is not None else routing.http_route if routing is not None else ""
        route, pools = await traffic_objects(self.api, namespace, name)
        copying = shifting and routing is not None and routing.endpoint_picker == EndpointPicker.COPY_BASELINE
        pickers: dict[str, Obj] = {}
        if copying or (recorded is not None and recorded.endpoint_picker is not None):
            for resource, kind in ((SERVICES, "Service"), (DEPLOYMENTS, "Deployment")):
                for obj in live(await self.api.list_objects(resource, namespace)):
                    pickers[f"{kind}/{obj['metadata']['name']}"] = obj
        return route, pools, pickers

    async def _checks(
        self, policy: KVPolicy, target: Obj, canary_pods: Sequence[PodView], now: datetime
    ) -> tuple[tuple[CheckVerdict, ...], tuple[PodView, ...]]:
        """The metrics checks due this pass, evaluated (none without an analyser), and the baseline pods they
        compared the canary with (none when no check needed them)."""
        if self.analyser is None:
            return (), ()
        canary_ready = any(pod.ready for pod in canary_pods)
        due = [check for check in checks_for(policy) if check_due(check, policy, canary_ready, now)]
        if not due:
            return (), ()
        baseline = await self._baseline(policy, target) if needs_baseline(due) else []
        window = analysis_window_seconds(policy, now)
        return await self.analyser.evaluate(policy, target, due, canary_pods, baseline, window), tuple(baseline)

    async def _baseline(self, policy: KVPolicy, target: Obj) -> list[PodView]:
        """The target's own serving pods (not the canary's that joined its Service)."""
        namespace = str(policy.metadata.get("namespace", ""))
        selector = target_kind(policy.spec.target_ref).serving_selector(target)
        target_pods = live(await self.api.list_objects(PODS, namespace, label_selector(selector)))
        return [
            pod_view(pod)
            for pod in target_pods
            if (pod["metadata"].get("labels") or {}).get(b.ROLE_LABEL) != b.ROLE_CANARY
        ]
