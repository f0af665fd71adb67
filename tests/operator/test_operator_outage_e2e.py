"""`kvpolicy run` through an API outage longer than kopf's own retries last (the operator used to exit after ~85 s of
5xx and come back only with a pod restart): it stays up, says so in /healthz and /metrics, and finishes the rollout."""

from __future__ import annotations

import time
from pathlib import Path

from e2e_helpers import policy, target, wait_decided, wait_phase, wait_until
from kvpolicy_dev.devcluster import ThreadedDevCluster
from operator_process import operator_process

# Well beyond kopf's default retries (1+1+2+3+5+8+13+21 s of backoff between 9 attempts): they gave up after ~85 s.
OUTAGE_SECONDS = 100.0


def test_the_operator_rides_out_an_api_outage_and_resumes_the_rollout(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    kvpolicy_crd: None,
    fixed_image_runner: None,
    tmp_path: Path,
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator_process(devcluster, tmp_path, "operator", "--namespace", ns) as operator:
        devcluster.create(policy(ns))
        wait_phase(devcluster, ns, {"AccuracyGate"})
        assert operator.metric("kvpolicy_api_reachable") == 1.0

        outage = devcluster.outage(503)  # every request, the watches' included, until it ends
        reports, reachable = [], []
        try:
            ends = time.monotonic() + OUTAGE_SECONDS
            while time.monotonic() < ends:
                assert operator.running(), f"the operator exited during the outage:\n{operator.output()[-5000:]}"
                health = operator.healthz()
                assert health is not None and health[0] == 200, "liveness must not fail: a restart cannot help"
                reports.append(health[1])
                reachable.append(operator.metric("kvpolicy_api_reachable"))
                time.sleep(2)
        finally:
            devcluster.end_fault(outage)

        assert reachable[-1] == 0.0 and reports[-1]["status"] == "degraded"
        assert reports[-1]["api"]["reachable"] is False and reports[-1]["api"]["lastError"] == "503"
        assert reports[-1]["api"]["unreachableSeconds"] >= OUTAGE_SECONDS - 10
        assert (operator.metric("kvpolicy_api_probe_failures_total") or 0) >= OUTAGE_SECONDS / 5 - 2

        done = wait_decided(devcluster, ns)
        assert done["status"]["phase"] == "Promoted", done["status"]
        wait_until(lambda: operator.metric("kvpolicy_api_reachable") == 1.0, "the probe to see the API again")
        health = operator.healthz()
        assert health is not None and health[1]["status"] == "ok" and health[1]["api"] == {"reachable": True}
        assert operator.metric("kvpolicy_operator_restarts_total") == 0.0, "ridden out, not restarted"
