"""The operator's own Prometheus metrics, served on its /metrics next to /healthz.

Alert rules in monitoring/alerts.yaml and the dashboard in monitoring/dashboard.json use these names; the module-level
functions update the process-wide `OPERATOR_METRICS`, tests build their own `OperatorMetrics`.

Only the replica that acts exports per-policy gauges and the policy counts: a replica that loses the leader Lease drops
them and ignores updates until it leads again, so a standby never keeps a stale phase deadline (KVPolicyRolloutStuck)
or a second count of every policy alive. Counters stay: they only grow while a replica acts, and `increase` over the
replicas' series adds up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpolicy import __version__
from kvpolicy.analysis.model import MeanCheck, RatioCheck, Verdict

# Rollouts take minutes (a bake) to hours (a long accuracy gate on a big model).
ROLLOUT_DURATION_BUCKETS = (60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0)
POLICY_INFO_LABELS = ("phase", "kv_cache", "gpu", "target", "decision", "reason")


@dataclass(frozen=True)
class PolicyInfo:
    """A policy's state as kvpolicy_policy_info's labels; an empty string where it has none yet (no plan, no
    decision)."""

    phase: str
    kv_cache: str = ""
    gpu: str = ""
    target: str = ""
    decision: str = ""
    reason: str = ""

    def labels(self) -> tuple[str, ...]:
        return tuple(getattr(self, name) for name in POLICY_INFO_LABELS)


class _PolicyGauge:
    """A gauge whose first two labels are (namespace, policy); it remembers its series so that a policy's can go."""

    def __init__(self, name: str, documentation: str, labels: list[str], registry: CollectorRegistry) -> None:
        self.gauge = Gauge(name, documentation, ["namespace", "policy", *labels], registry=registry)
        # Per (namespace, policy): removing a policy's series (every pass, for the phase deadline) must not scan every
        # policy's, or N policies cost N^2 per period.
        self._series: dict[tuple[str, ...], set[tuple[str, ...]]] = {}

    def set(self, labels: tuple[str, ...], value: float | None) -> None:
        """Set a series, or remove it when there is no value."""
        policy = self._series.get(labels[:2])
        if value is None:
            if policy is not None and labels in policy:
                self.gauge.remove(*labels)
                policy.discard(labels)
                if not policy:
                    del self._series[labels[:2]]
            return
        self.gauge.labels(*labels).set(value)
        self._series.setdefault(labels[:2], set()).add(labels)

    def remove_policy(self, namespace: str, policy: str, *rest: str) -> None:
        """Remove a policy's series (those whose next labels are `rest`, when given)."""
        prefix = (namespace, policy, *rest)
        for labels in [
            labels for labels in self._series.get((namespace, policy), ()) if labels[: len(prefix)] == prefix
        ]:
            self.set(labels, None)

    def clear(self) -> None:
        self.gauge.clear()
        self._series.clear()

    def policies(self) -> int:
        """How many policies have a series."""
        return len(self._series)


class OperatorMetrics:
    """Every metric the operator exports, in a registry of its own (so tests and the default registry stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.build_info = Gauge("kvpolicy_build_info", "1, labelled with the version.", ["version"], registry=registry)
        self.build_info.labels(version=__version__).set(1)
        self.policies = Gauge("kvpolicy_policies", "KVPolicies by phase.", ["phase"], registry=registry)
        self.decisions = Counter(
            "kvpolicy_decisions",
            "Rollout decisions taken (result: Promoted, RolledBack, ...; reason: CamelCase cause).",
            ["namespace", "policy", "result", "reason"],
            registry=registry,
        )
        self.gate_results = Counter(
            "kvpolicy_gate_results", "Gate runs by gate and verdict.", ["gate", "verdict"], registry=registry
        )
        self.gate_recovery = _PolicyGauge(
            "kvpolicy_gate_recovery_ratio",
            "Canary score over baseline score in the latest run of a gate (1 = full recovery).",
            ["gate"],
            registry,
        )
        self.gate_min_recovery = _PolicyGauge(
            "kvpolicy_gate_min_recovery_ratio",
            "The least recovery the gate accepts (the policy's gates.accuracy.minRecovery), beside its latest run.",
            ["gate"],
            registry,
        )
        self.gate_score = _PolicyGauge(
            "kvpolicy_gate_score", "Score of each variant in the latest run of a gate.", ["gate", "variant"], registry
        )
        # One series per policy, value 1, carrying its state as labels (kube-state-metrics' *_info style): a table
        # panel shows every policy, and an alert can join on it (`unless on (namespace, policy) kvpolicy_policy_info`).
        self.policy_info = _PolicyGauge(
            "kvpolicy_policy_info",
            "1 per KVPolicy, labelled with its phase, planned KV cache dtype, GPU, target and last decision.",
            list(POLICY_INFO_LABELS),
            registry,
        )
        # Per policy, so that an alert can tell a policy whose checks all came back inconclusive (a stalled analysis).
        self.verdicts = Counter(
            "kvpolicy_analysis_verdicts",
            "Latency analysis checks by policy and verdict.",
            ["namespace", "policy", "verdict"],
            registry=registry,
        )
        # Which pods are the canary and which the baseline, for joining vLLM's own series by side (the dashboard's
        # canary-vs-baseline panels): `* on (namespace, pod) group_left (policy, role) kvpolicy_rollout_pod_info`.
        self.rollout_pods = _PolicyGauge(
            "kvpolicy_rollout_pod_info",
            "1 per pod of a rollout in progress: the canary's, and the target's own pods it is compared with (role).",
            ["role", "pod"],
            registry,
        )
        self.latency_seconds = _PolicyGauge(
            "kvpolicy_analysis_latency_seconds",
            "Latency quantile of each side in the latest analysis check.",
            ["metric", "quantile", "role"],
            registry,
        )
        self.latency_ratio = _PolicyGauge(
            "kvpolicy_analysis_latency_ratio",
            "Canary over baseline latency quantile in the latest analysis check.",
            ["metric", "quantile"],
            registry,
        )
        self.latency_max_ratio = _PolicyGauge(
            "kvpolicy_analysis_latency_max_ratio",
            "The ratio threshold of each latency comparison.",
            ["metric", "quantile"],
            registry,
        )
        self.traffic_share = _PolicyGauge(
            "kvpolicy_canary_traffic_share_ratio",
            "The canary's share of the users' requests (0-1): intended (a step's weight or its pods' share) and "
            "measured from the servers' vllm:request_success_total over the latest analysis check's window.",
            ["kind"],
            registry,
        )
        self.rollout_duration = Histogram(
            "kvpolicy_rollout_duration_seconds",
            "Time from a rollout's start to its final decision.",
            ["result"],
            buckets=ROLLOUT_DURATION_BUCKETS,
            registry=registry,
        )
        self.reconcile_errors = Counter(
            "kvpolicy_reconcile_errors", "Reconcile attempts that failed, by kind.", ["kind"], registry=registry
        )
        self.phase_deadline = _PolicyGauge(
            "kvpolicy_policy_phase_deadline_timestamp_seconds",
            "Unix time by which a policy's current phase must end; absent for phases without a deadline.",
            ["phase"],
            registry,
        )
        self.notifications = Counter(
            "kvpolicy_notifications",
            "Notifications to webhooks by format and result: sent, failed (after every retry) or dropped (the "
            "receiver's queue was full).",
            ["format", "result"],
            registry=registry,
        )
        # The operator process itself (runtime/supervisor.py): is the API server answering, does this replica act.
        self.api_reachable = Gauge(
            "kvpolicy_api_reachable",
            "1 while the Kubernetes API server answers the operator's probe (GET /readyz), else 0.",
            registry=registry,
        )
        self.api_probe_failures = Counter(
            "kvpolicy_api_probe_failures",
            "Probes of the Kubernetes API server that failed, by reason (HTTP status code, Timeout, ConnectionError).",
            ["reason"],
            registry=registry,
        )
        self.leader = Gauge(
            "kvpolicy_leader",
            "1 while this replica acts on policies (it holds the leader Lease, or runs without leader election).",
            registry=registry,
        )
        self.operator_restarts = Counter(
            "kvpolicy_operator_restarts",
            "Times the operator's kopf engine failed and was started again inside the process.",
            registry=registry,
        )
        self._phases_seen: set[str] = set()
        # Per (namespace, policy), as _PolicyGauge keeps its series.
        self._verdict_series: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
        self._decision_series: dict[tuple[str, str], set[tuple[str, str, str, str]]] = {}
        # False from losing the leader Lease until leading again (set_leader): per-policy gauges are neither kept
        # nor updated (a pass still running while kopf stops would otherwise bring one back).
        self._acting = True

    def _policy_gauges(self) -> tuple[_PolicyGauge, ...]:
        return (
            self.gate_recovery,
            self.gate_min_recovery,
            self.gate_score,
            self.policy_info,
            self.rollout_pods,
            self.latency_seconds,
            self.latency_ratio,
            self.latency_max_ratio,
            self.phase_deadline,
            self.traffic_share,
        )

    def set_policies_by_phase(self, counts: Mapping[str, int]) -> None:
        """Set the count of every phase; phases seen before and missing now drop to 0."""
        if not self._acting:
            return
        self._phases_seen |= set(counts)
        for phase in self._phases_seen:
            self.policies.labels(phase=phase).set(counts.get(phase, 0))

    def record_decision(self, result: str, reason: str, namespace: str = "", policy: str = "") -> None:
        self.decisions.labels(namespace=namespace, policy=policy, result=result, reason=reason).inc()
        self._decision_series.setdefault((namespace, policy), set()).add((namespace, policy, result, reason))

    def record_gate_result(
        self,
        policy: str,
        namespace: str,
        gate: str,
        verdict: str,
        recovery: float | None,
        canary_score: float | None,
        baseline_score: float | None,
        min_recovery: float | None = None,
    ) -> None:
        self.count_gate_result(gate, verdict)
        if not self._acting:
            return
        self.gate_recovery.set((namespace, policy, gate), recovery)
        self.gate_min_recovery.set((namespace, policy, gate), min_recovery if recovery is not None else None)
        self.gate_score.set((namespace, policy, gate, "canary"), canary_score)
        self.gate_score.set((namespace, policy, gate, "baseline"), baseline_score)

    def count_gate_result(self, gate: str, verdict: str) -> None:
        """Count one gate's verdict (a metrics check's, which has no recovery or scores to publish)."""
        self.gate_results.labels(gate=gate, verdict=verdict).inc()

    def clear_gate(self, namespace: str, policy: str, gate: str) -> None:
        """Drop a gate's numbers: a new rollout cleared its result, so they no longer describe the policy."""
        for gauge in (self.gate_recovery, self.gate_min_recovery, self.gate_score):
            gauge.remove_policy(namespace, policy, gate)

    def set_rollout_pods(self, namespace: str, policy: str, role: str, pods: Iterable[str]) -> None:
        """Publish the pods of one side of a rollout (role canary or baseline); none: that side has no pods now."""
        if not self._acting:
            return
        self.rollout_pods.remove_policy(namespace, policy, role)
        for pod in pods:
            self.rollout_pods.set((namespace, policy, role, pod), 1)

    def set_policy_info(self, namespace: str, policy: str, info: PolicyInfo) -> None:
        """Publish a policy's state as the labels of its one kvpolicy_policy_info series."""
        if not self._acting:
            return
        self.policy_info.remove_policy(namespace, policy)
        self.policy_info.set((namespace, policy, *info.labels()), 1)

    def record_verdict(self, namespace: str, policy: str, verdict: str) -> None:
        self.verdicts.labels(namespace=namespace, policy=policy, verdict=verdict).inc()
        self._verdict_series.setdefault((namespace, policy), set()).add((namespace, policy, verdict))

    def record_analysis(self, namespace: str, policy: str, verdict: Verdict) -> None:
        """Count the verdict and publish its numbers; a check without numbers clears the previous ones."""
        self.record_verdict(namespace, policy, verdict.kind.value)
        self.clear_analysis(namespace, policy)
        if not self._acting:
            return
        # Publish what the gate decided on: resolved quantiles, and means (quantile="mean") where the quantiles of
        # both sides fell in one bucket, so alerts never fire on a ratio the gate ignored.
        compared: list[tuple[RatioCheck | MeanCheck, str]] = [
            (c, f"{c.quantile:g}") for c in verdict.checks if c.resolved
        ]
        compared += [(m, "mean") for m in verdict.mean_checks]
        for check, statistic in compared:
            series = (namespace, policy, check.metric, statistic)
            self.latency_ratio.set(series, check.ratio)
            self.latency_max_ratio.set(series, check.max_ratio)
            self.latency_seconds.set((*series, "canary"), check.canary_seconds)
            self.latency_seconds.set((*series, "baseline"), check.baseline_seconds)

    def clear_analysis(self, namespace: str, policy: str) -> None:
        """Drop a policy's latency series (its analysis ended or its last check had nothing to compare)."""
        for gauge in (self.latency_ratio, self.latency_max_ratio, self.latency_seconds):
            gauge.remove_policy(namespace, policy)

    def set_traffic_share(self, namespace: str, policy: str, intended: float | None, measured: float | None) -> None:
        """Publish the canary's intended and measured share (0-1); None removes a series (no canary serving)."""
        if not self._acting:
            return
        self.traffic_share.set((namespace, policy, "intended"), intended)
        self.traffic_share.set((namespace, policy, "measured"), measured)

    def observe_rollout_duration(self, seconds: float, result: str) -> None:
        self.rollout_duration.labels(result=result).observe(seconds)

    def record_reconcile_error(self, kind: str) -> None:
        self.reconcile_errors.labels(kind=kind).inc()

    def set_phase_deadline(self, namespace: str, policy: str, phase: str, deadline: float | None) -> None:
        """Publish the Unix time by which `phase` must end (RolloutStuck fires past it); None: no deadline."""
        if not self._acting:
            return
        self.phase_deadline.remove_policy(namespace, policy)
        self.phase_deadline.set((namespace, policy, phase), deadline)

    def forget_policy(self, namespace: str, policy: str) -> None:
        """Drop every per-policy series of a deleted KVPolicy."""
        for gauge in self._policy_gauges():
            gauge.remove_policy(namespace, policy)
        for series in self._verdict_series.pop((namespace, policy), set()):
            self.verdicts.remove(*series)
        # A deleted policy's decisions too: policies come and go, and each kept its series for the process's life.
        for decision in self._decision_series.pop((namespace, policy), set()):
            self.decisions.remove(*decision)

    def record_notification(self, format_: str, result: str) -> None:
        self.notifications.labels(format=format_, result=result).inc()

    def set_api_reachable(self, reachable: bool, failure: str | None = None) -> None:
        self.api_reachable.set(1 if reachable else 0)
        if failure is not None:
            self.api_probe_failures.labels(reason=failure).inc()

    def set_leader(self, acting: bool) -> None:
        """Whether this replica acts; one that stops acting drops every per-policy gauge and the policy counts (the
        new leader exports them)."""
        self.leader.set(1 if acting else 0)
        self._acting = acting
        if not acting:
            for gauge in self._policy_gauges():
                gauge.clear()
            self.policies.clear()
            self._phases_seen.clear()

    def record_operator_restart(self) -> None:
        self.operator_restarts.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


OPERATOR_METRICS = OperatorMetrics()

set_policies_by_phase = OPERATOR_METRICS.set_policies_by_phase
record_decision = OPERATOR_METRICS.record_decision
record_gate_result = OPERATOR_METRICS.record_gate_result
count_gate_result = OPERATOR_METRICS.count_gate_result
clear_gate = OPERATOR_METRICS.clear_gate
set_policy_info = OPERATOR_METRICS.set_policy_info
set_rollout_pods = OPERATOR_METRICS.set_rollout_pods
record_verdict = OPERATOR_METRICS.record_verdict
record_analysis = OPERATOR_METRICS.record_analysis
clear_analysis = OPERATOR_METRICS.clear_analysis
observe_rollout_duration = OPERATOR_METRICS.observe_rollout_duration
set_traffic_share = OPERATOR_METRICS.set_traffic_share
record_reconcile_error = OPERATOR_METRICS.record_reconcile_error
set_phase_deadline = OPERATOR_METRICS.set_phase_deadline
forget_policy = OPERATOR_METRICS.forget_policy
record_notification = OPERATOR_METRICS.record_notification
set_api_reachable = OPERATOR_METRICS.set_api_reachable
set_leader = OPERATOR_METRICS.set_leader
record_operator_restart = OPERATOR_METRICS.record_operator_restart


def metrics_app(metrics: OperatorMetrics = OPERATOR_METRICS) -> web.Application:
    """An aiohttp app serving /metrics (Prometheus text format) and /healthz."""

    async def serve_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def serve_health(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    app.router.add_get("/healthz", serve_health)
    return app


async def start_metrics_server(host: str, port: int, metrics: OperatorMetrics = OPERATOR_METRICS) -> web.AppRunner:
    """Serve `metrics_app` on host:port in the running event loop; `await runner.cleanup()` stops it."""
    runner = web.AppRunner(metrics_app(metrics), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
