"""The operator's own metrics: what each recording function exports, and the /metrics and /healthz endpoints."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvpolicy.analysis.model import LatencyGateConfig, SideMetrics
from kvpolicy.analysis.verdicts import assess
from kvpolicy.api.v1alpha1 import GateVerdict
from kvpolicy.notify.metrics import OperatorMetrics, PolicyInfo, metrics_app
from prometheus_client.parser import text_string_to_metric_families


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def side(role: str, ttft: float, requests: float = 100) -> SideMetrics:
    quantiles = {0.5: ttft, 0.95: ttft * 2}
    return SideMetrics(role, True, requests, 300, quantiles, {0.5: 0.01, 0.95: 0.02})


CONFIG = LatencyGateConfig(ttft_max_ratio=1.2, itl_max_ratio=1.2)


def test_policies_by_phase_resets_phases_that_emptied() -> None:
    metrics = OperatorMetrics()
    metrics.set_policies_by_phase({"Canary": 2, "Baking": 1})
    metrics.set_policies_by_phase({"Promoted": 3})
    assert value(metrics, "kvpolicy_policies", phase="Canary") == 0
    assert value(metrics, "kvpolicy_policies", phase="Baking") == 0
    assert value(metrics, "kvpolicy_policies", phase="Promoted") == 3


def test_decisions_and_durations() -> None:
    metrics = OperatorMetrics()
    metrics.record_decision("RolledBack", "TTFTRatioExceeded", "llm", "m")
    metrics.record_decision("RolledBack", "TTFTRatioExceeded", "llm", "m")
    metrics.record_decision("Promoted", "AnalysisPassed")
    labels = {"namespace": "llm", "policy": "m", "result": "RolledBack", "reason": "TTFTRatioExceeded"}
    assert value(metrics, "kvpolicy_decisions_total", **labels) == 2
    promoted = {"namespace": "", "policy": "", "result": "Promoted", "reason": "AnalysisPassed"}
    assert value(metrics, "kvpolicy_decisions_total", **promoted) == 1
    metrics.observe_rollout_duration(700, "Promoted")
    assert value(metrics, "kvpolicy_rollout_duration_seconds_bucket", result="Promoted", le="600.0") == 0
    assert value(metrics, "kvpolicy_rollout_duration_seconds_bucket", result="Promoted", le="1200.0") == 1
    metrics.record_reconcile_error("ApiException")
    assert value(metrics, "kvpolicy_reconcile_errors_total", kind="ApiException") == 1


def test_gate_results_and_missing_scores() -> None:
    metrics = OperatorMetrics()
    metrics.record_gate_result("m", "llm", "accuracy", "Fail", 0.8, 0.4, 0.5)
    assert value(metrics, "kvpolicy_gate_results_total", gate="accuracy", verdict="Fail") == 1
    assert value(metrics, "kvpolicy_gate_recovery_ratio", namespace="llm", policy="m", gate="accuracy") == 0.8
    assert (
        value(metrics, "kvpolicy_gate_score", namespace="llm", policy="m", gate="accuracy", variant="baseline") == 0.5
    )
    # A gate run without scores (it errored) must not leave the old ones behind.
    metrics.record_gate_result("m", "llm", "accuracy", "Error", None, None, None)
    assert value(metrics, "kvpolicy_gate_recovery_ratio", namespace="llm", policy="m", gate="accuracy") is None
    assert value(metrics, "kvpolicy_gate_score", namespace="llm", policy="m", gate="accuracy", variant="canary") is None
    assert value(metrics, "kvpolicy_gate_results_total", gate="accuracy", verdict="Error") == 1


def test_analysis_numbers_follow_the_latest_check() -> None:
    metrics = OperatorMetrics()
    breach = assess(CONFIG, side("canary", 0.3), side("baseline", 0.2))
    metrics.record_analysis("llm", "m", breach)
    ttft_p95 = {"namespace": "llm", "policy": "m", "metric": "ttft", "quantile": "0.95"}
    assert value(metrics, "kvpolicy_analysis_latency_ratio", **ttft_p95) == pytest.approx(1.5)
    assert value(metrics, "kvpolicy_analysis_latency_max_ratio", **ttft_p95) == 1.2
    assert value(metrics, "kvpolicy_analysis_latency_seconds", **ttft_p95, role="canary") == pytest.approx(0.6)
    assert value(metrics, "kvpolicy_analysis_latency_seconds", **ttft_p95, role="baseline") == pytest.approx(0.4)
    assert value(metrics, "kvpolicy_analysis_verdicts_total", namespace="llm", policy="m", verdict="Breach") == 1
    no_data = assess(CONFIG, side("canary", 0.3, requests=0), side("baseline", 0.2))
    assert no_data.kind is GateVerdict.NO_DATA
    metrics.record_analysis("llm", "m", no_data)
    assert value(metrics, "kvpolicy_analysis_latency_ratio", **ttft_p95) is None
    assert value(metrics, "kvpolicy_analysis_verdicts_total", namespace="llm", policy="m", verdict="NoData") == 1


def test_phase_deadline_moves_with_the_phase_and_policies_are_forgotten() -> None:
    metrics = OperatorMetrics()
    metrics.set_phase_deadline("llm", "m", "Canary", 1000.0)
    metrics.set_phase_deadline("llm", "m", "Baking", 2000.0)
    metrics.set_phase_deadline("llm", "other", "Canary", 3000.0)
    deadline = "kvpolicy_policy_phase_deadline_timestamp_seconds"
    assert value(metrics, deadline, namespace="llm", policy="m", phase="Canary") is None
    assert value(metrics, deadline, namespace="llm", policy="m", phase="Baking") == 2000
    metrics.record_gate_result("m", "llm", "accuracy", "Pass", 0.99, 0.9, 0.91)
    metrics.record_analysis("llm", "m", assess(CONFIG, side("canary", 0.2), side("baseline", 0.2)))
    metrics.forget_policy("llm", "m")
    exposition = metrics.exposition().decode()
    assert 'policy="m"' not in exposition  # verdict counts included
    assert value(metrics, deadline, namespace="llm", policy="other", phase="Canary") == 3000
    metrics.set_phase_deadline("llm", "other", "Promoted", None)
    assert value(metrics, deadline, namespace="llm", policy="other", phase="Canary") is None


def test_a_deleted_policys_decisions_leave_with_it() -> None:
    """Policies created and deleted by the thousand must not leave a series each behind."""
    metrics = OperatorMetrics()
    for index in range(100):
        metrics.record_decision("HeldBF16", "BelowDecodeBreakEven", "llm", f"p{index}")
        metrics.forget_policy("llm", f"p{index}")
    metrics.record_decision("Promoted", "GatesPassed", "llm", "kept")
    [decisions] = [family for family in metrics.registry.collect() if family.name == "kvpolicy_decisions"]
    assert {sample.labels["policy"] for sample in decisions.samples} == {"kept"}


def test_a_policys_series_are_found_without_looking_at_every_policys() -> None:
    """Every pass replaces its policy's phase deadline: with the series in one set, each pass scanned every
    policy's (5,000 policies: 25 million comparisons per poll period)."""
    metrics = OperatorMetrics()
    for index in range(1000):
        metrics.set_phase_deadline("llm", f"p{index}", "Canary", 1000.0)
    metrics.set_phase_deadline("llm", "p1", "Baking", 2000.0)
    metrics.forget_policy("llm", "p2")
    assert metrics.phase_deadline.policies() == 999
    deadline = "kvpolicy_policy_phase_deadline_timestamp_seconds"
    assert value(metrics, deadline, namespace="llm", policy="p1", phase="Baking") == 2000
    assert value(metrics, deadline, namespace="llm", policy="p1", phase="Canary") is None
    assert value(metrics, deadline, namespace="llm", policy="p2", phase="Canary") is None


def test_instances_do_not_share_state() -> None:
    first, second = OperatorMetrics(), OperatorMetrics()
    first.record_verdict("llm", "m", "Pass")
    assert value(second, "kvpolicy_analysis_verdicts_total", namespace="llm", policy="m", verdict="Pass") is None


async def test_metrics_and_health_endpoints() -> None:
    metrics = OperatorMetrics()
    metrics.record_verdict("llm", "m", "ProviderUnavailable")
    async with TestClient(TestServer(metrics_app(metrics))) as client:
        health = await client.get("/healthz")
        assert health.status == 200 and await health.text() == "ok\n"
        response = await client.get("/metrics")
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        families = {family.name: family for family in text_string_to_metric_families(await response.text())}
    assert families["kvpolicy_build_info"].samples[0].value == 1
    verdicts = families["kvpolicy_analysis_verdicts"].samples
    expected = {"namespace": "llm", "policy": "m", "verdict": "ProviderUnavailable"}
    assert any(s.labels == expected and s.value == 1 for s in verdicts)


def test_unresolved_quantiles_are_not_published_and_the_means_are() -> None:
    """ITL below vLLM's first 10 ms bucket on both sides: the gate compared means, so the metrics show the means."""
    bounds = (0.01, 0.025, 0.05, float("inf"))

    def fast_decoder(role: str, itl_mean: float) -> SideMetrics:
        return SideMetrics(
            role,
            True,
            100,
            300,
            {0.5: 0.2, 0.95: 0.4},
            {0.5: 0.005, 0.95: 0.0095},
            itl_mean_seconds=itl_mean,
            ttft_mean_seconds=0.25,
            itl_bucket_bounds=bounds,
        )

    metrics = OperatorMetrics()
    verdict = assess(CONFIG, fast_decoder("canary", 0.0078), fast_decoder("baseline", 0.006))
    assert verdict.kind is GateVerdict.BREACH
    metrics.record_analysis("llm", "m", verdict)
    itl = {"namespace": "llm", "policy": "m", "metric": "itl"}
    assert value(metrics, "kvpolicy_analysis_latency_ratio", **itl, quantile="0.5") is None
    assert value(metrics, "kvpolicy_analysis_latency_ratio", **itl, quantile="0.95") is None
    assert value(metrics, "kvpolicy_analysis_latency_ratio", **itl, quantile="mean") == pytest.approx(1.3)


def test_the_canary_traffic_share_is_intended_and_measured_until_forgotten() -> None:
    metrics = OperatorMetrics()
    metrics.set_traffic_share("llm", "m", 0.1, 0.096)
    assert value(metrics, "kvpolicy_canary_traffic_share_ratio", namespace="llm", policy="m", kind="intended") == 0.1
    assert value(metrics, "kvpolicy_canary_traffic_share_ratio", namespace="llm", policy="m", kind="measured") == 0.096
    metrics.set_traffic_share("llm", "m", 0.5, None)  # the next step, not measured yet
    assert value(metrics, "kvpolicy_canary_traffic_share_ratio", namespace="llm", policy="m", kind="measured") is None
    metrics.forget_policy("llm", "m")
    assert value(metrics, "kvpolicy_canary_traffic_share_ratio", namespace="llm", policy="m", kind="intended") is None


def test_a_replica_that_loses_the_lease_exports_no_policy_gauges() -> None:
    """A standby's stale phase deadline would fire KVPolicyRolloutStuck for a policy the new leader has moved on, and
    its policy counts would double every sum: it drops them, ignores passes still finishing, and exports again once
    it leads."""
    metrics = OperatorMetrics()
    metrics.set_leader(True)
    metrics.set_policies_by_phase({"AccuracyGate": 1})
    metrics.set_phase_deadline("llm", "m", "AccuracyGate", 1000.0)
    metrics.record_gate_result("m", "llm", "accuracy", "Fail", 0.8, 0.4, 0.5, 0.95)
    metrics.record_analysis("llm", "m", assess(CONFIG, side("canary", 0.3), side("baseline", 0.2)))
    metrics.set_policy_info("llm", "m", PolicyInfo(phase="AccuracyGate"))
    metrics.record_decision("RolledBack", "AccuracyRecoveryBelowMinimum", "llm", "m")

    metrics.set_leader(False)
    metrics.set_phase_deadline("llm", "m", "RollingBack", 2000.0)  # a pass that was still running
    metrics.set_policy_info("llm", "m", PolicyInfo(phase="RollingBack"))
    metrics.set_policies_by_phase({"RollingBack": 1})
    metrics.record_gate_result("m", "llm", "accuracy", "Fail", 0.8, 0.4, 0.5, 0.95)
    families = {family.name: family for family in text_string_to_metric_families(metrics.exposition().decode())}
    # (The text parser reads the counters' `_created` samples as gauges of their own.)
    gauges = [n for n, family in families.items() if family.type == "gauge" and family.samples and "_created" not in n]
    assert sorted(gauges) == ["kvpolicy_api_reachable", "kvpolicy_build_info", "kvpolicy_leader"]
    assert value(metrics, "kvpolicy_leader") == 0
    # Counters only grow while a replica acts; the new leader's series add to them.
    labels = {"namespace": "llm", "policy": "m", "result": "RolledBack", "reason": "AccuracyRecoveryBelowMinimum"}
    assert value(metrics, "kvpolicy_decisions_total", **labels) == 1

    metrics.set_leader(True)
    metrics.set_phase_deadline("llm", "m", "RollingBack", 2000.0)
    metrics.set_policies_by_phase({"RollingBack": 1})
    deadline = "kvpolicy_policy_phase_deadline_timestamp_seconds"
    assert value(metrics, deadline, namespace="llm", policy="m", phase="RollingBack") == 2000
    assert value(metrics, "kvpolicy_policies", phase="RollingBack") == 1
    assert value(metrics, "kvpolicy_policies", phase="AccuracyGate") is None


def test_the_accuracy_gate_publishes_the_policys_min_recovery_and_a_new_rollout_clears_it() -> None:
    metrics = OperatorMetrics()
    metrics.record_gate_result("m", "llm", "accuracy", "Pass", 0.93, 0.84, 0.9, 0.9)
    gate = {"namespace": "llm", "policy": "m", "gate": "accuracy"}
    assert value(metrics, "kvpolicy_gate_recovery_ratio", **gate) == 0.93
    assert value(metrics, "kvpolicy_gate_min_recovery_ratio", **gate) == 0.9
    metrics.record_gate_result("other", "llm", "accuracy", "Pass", 0.99, 0.9, 0.91, 0.95)
    metrics.clear_gate("llm", "m", "accuracy")
    assert value(metrics, "kvpolicy_gate_recovery_ratio", **gate) is None
    assert value(metrics, "kvpolicy_gate_min_recovery_ratio", **gate) is None
    assert value(metrics, "kvpolicy_gate_score", **gate, variant="canary") is None
    assert value(metrics, "kvpolicy_gate_min_recovery_ratio", namespace="llm", policy="other", gate="accuracy") == 0.95


def test_policy_info_is_one_series_per_policy() -> None:
    metrics = OperatorMetrics()
    metrics.set_policy_info("llm", "m", PolicyInfo(phase="AccuracyGate", kv_cache="FP8", gpu="NVIDIA-H200"))
    done = PolicyInfo("RolledBack", "FP8", "NVIDIA-H200", "Deployment/llama", "RolledBack", "AccuracyInconclusive")
    metrics.set_policy_info("llm", "m", done)
    samples = next(s for s in metrics.registry.collect() if s.name == "kvpolicy_policy_info").samples
    assert [(s.labels, s.value) for s in samples] == [
        (
            {
                "namespace": "llm",
                "policy": "m",
                "phase": "RolledBack",
                "kv_cache": "FP8",
                "gpu": "NVIDIA-H200",
                "target": "Deployment/llama",
                "decision": "RolledBack",
                "reason": "AccuracyInconclusive",
            },
            1.0,
        )
    ]
    metrics.forget_policy("llm", "m")
    assert 'policy="m"' not in metrics.exposition().decode()
