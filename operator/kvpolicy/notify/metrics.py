"""The operator's own Prometheus metrics, served on its /metrics next to /healthz.

Alert rules in monitoring/alerts.yaml and the dashboard in monitoring/dashboard.json use these names; the module-level
functions update the process-wide `OPERATOR_METRICS`, tests build their own `OperatorMetrics`.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpolicy import __version__
from kvpolicy.analysis.model import MeanCheck, RatioCheck, Verdict

# Rollouts take minutes (a bake) to hours (a long accuracy gate on a big model).
ROLLOUT_DURATION_BUCKETS = (60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0)


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

    def remove_policy(self, namespace: str, policy: str) -> None:
        for labels in list(self._series.get((namespace, policy), ())):
            self.set(labels, None)

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
        self.gate_score = _PolicyGauge(
            "kvpolicy_gate_score", "Score of each variant in the latest run of a gate.", ["gate", "variant"], registry
        )
        # Per policy, so that an alert can tell a policy whose checks all came back inconclusive (a stalled analysis).
        self.verdicts = Counter(
            "kvpolicy_analysis_verdicts",
            "Latency analysis checks by policy and verdict.",
            ["namespace", "policy", "verdict"],
            registry=registry,
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

    def set_policies_by_phase(self, counts: Mapping[str, int]) -> None:
        """Set the count of every phase; phases seen before and missing now drop to 0."""
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
    ) -> None:
        self.gate_results.labels(gate=gate, verdict=verdict).inc()
        self.gate_recovery.set((namespace, policy, gate), recovery)
        self.gate_score.set((namespace, policy, gate, "canary"), canary_score)
        self.gate_score.set((namespace, policy, gate, "baseline"), baseline_score)

    def record_verdict(self, namespace: str, policy: str, verdict: str) -> None:
        self.verdicts.labels(namespace=namespace, policy=policy, verdict=verdict).inc()
        self._verdict_series.setdefault((namespace, policy), set()).add((namespace, policy, verdict))

    def record_analysis(self, namespace: str, policy: str, verdict: Verdict) -> None:
        """Count the verdict and publish its numbers; a check without numbers clears the previous ones."""
        self.record_verdict(namespace, policy, verdict.kind.value)
        self.clear_analysis(namespace, policy)
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

    def observe_rollout_duration(self, seconds: float, result: str) -> None:
        self.rollout_duration.labels(result=result).observe(seconds)

    def record_reconcile_error(self, kind: str) -> None:
        self.reconcile_errors.labels(kind=kind).inc()

    def set_phase_deadline(self, namespace: str, policy: str, phase: str, deadline: float | None) -> None:
        """Publish the Unix time by which `phase` must end (RolloutStuck fires past it); None: no deadline."""
        self.phase_deadline.remove_policy(namespace, policy)
        self.phase_deadline.set((namespace, policy, phase), deadline)

    def forget_policy(self, namespace: str, policy: str) -> None:
        """Drop every per-policy series of a deleted KVPolicy."""
        for gauge in (self.gate_recovery, self.gate_score, self.phase_deadline):
            gauge.remove_policy(namespace, policy)
        self.clear_analysis(namespace, policy)
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
        self.leader.set(1 if acting else 0)

    def record_operator_restart(self) -> None:
        self.operator_restarts.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


OPERATOR_METRICS = OperatorMetrics()

set_policies_by_phase = OPERATOR_METRICS.set_policies_by_phase
record_decision = OPERATOR_METRICS.record_decision
record_gate_result = OPERATOR_METRICS.record_gate_result
record_verdict = OPERATOR_METRICS.record_verdict
record_analysis = OPERATOR_METRICS.record_analysis
clear_analysis = OPERATOR_METRICS.clear_analysis
observe_rollout_duration = OPERATOR_METRICS.observe_rollout_duration
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
