"""Serve the operator's metrics as an operator in trouble would export them, for the live monitoring test:
a rollback, a low accuracy recovery the policy did not roll back on, a TTFT breach, a rollout past its deadline,
reconcile errors, and an operator that cannot reach the API server and so acts on nothing (`kvpolicy_leader` stays at
its initial 0: `set_leader(False)` would also drop the per-policy series, as a standby's are)."""

from __future__ import annotations

import argparse
import asyncio
import time

from kvpolicy.analysis.model import LatencyGateConfig, SideMetrics
from kvpolicy.analysis.verdicts import assess
from kvpolicy.notify.metrics import OperatorMetrics, PolicyInfo, start_metrics_server

CANARY_POD = "slow-canary-g1-7d9f8c6b5-abcde"
BASELINE_POD = "slow-5c8d7b6f4-fghij"


def record_a_troubled_fleet(metrics: OperatorMetrics) -> None:
    metrics.set_policies_by_phase({"Baking": 1, "Canary": 1, "RolledBack": 1})
    metrics.record_gate_result("lossy", "llm", "accuracy", "Fail", 0.8, 0.4, 0.5, 0.95)
    metrics.record_decision("RolledBack", "AccuracyRecoveryBelowMinimum", "llm", "lossy")
    rolled_back = PolicyInfo(
        "RolledBack", "FP8", "NVIDIA-H200", "Deployment/llama", "RolledBack", "AccuracyInconclusive"
    )
    metrics.set_policy_info("llm", "lossy", rolled_back)
    metrics.record_gate_result("unrolled", "llm", "accuracy", "Fail", 0.8, 0.4, 0.5, 0.95)
    metrics.set_policy_info("llm", "unrolled", PolicyInfo("AccuracyGate", "FP8", "NVIDIA-H200", "Deployment/chat"))
    metrics.observe_rollout_duration(900, "RolledBack")
    canary = SideMetrics("canary", True, 100, 300, {0.5: 0.3, 0.95: 0.6}, {0.5: 0.01, 0.95: 0.02})
    baseline = SideMetrics("baseline", True, 100, 300, {0.5: 0.2, 0.95: 0.4}, {0.5: 0.01, 0.95: 0.02})
    metrics.record_analysis("llm", "slow", assess(LatencyGateConfig(), canary, baseline))
    metrics.set_policy_info("llm", "slow", PolicyInfo("LatencyAnalysis", "FP8", "NVIDIA-H200", "Deployment/slow"))
    # The pods of "slow"'s sides, which test_monitoring_live.py serves as vLLM stand-ins.
    metrics.set_rollout_pods("llm", "slow", "canary", [CANARY_POD])
    metrics.set_rollout_pods("llm", "slow", "baseline", [BASELINE_POD])
    metrics.set_phase_deadline("llm", "stuck", "Canary", time.time() - 3600)
    metrics.record_reconcile_error("ApiException")
    metrics.set_api_reachable(False, "503")
    metrics.set_traffic_share("llm", "skewed", 0.1, 0.3)


async def serve(port: int) -> None:
    metrics = OperatorMetrics()
    record_a_troubled_fleet(metrics)
    runner = await start_metrics_server("127.0.0.1", port, metrics)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
