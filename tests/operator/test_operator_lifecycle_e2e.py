"""Living with a rollout on the dev cluster: a GitOps-style revert of a promoted target (kubectl apply of the original
manifest) raises Drifted and runs the gates again, a replicas change does not; Advisory mode completes a rollout
without one write to the target; notifications reach a loopback receiver for every phase change while a failing and
a hanging receiver change nothing."""

from __future__ import annotations

import base64
import json

import pytest
import yaml
from e2e_helpers import (
    KUBECTL,
    KVP,
    PATCHED_IMAGE,
    TARGET_IMAGE,
    OperatorFactory,
    container,
    event_reasons,
    kubectl,
    policy,
    ready_pods,
    target,
    wait_phase,
    wait_until,
)
from kvpolicy_dev.devcluster import ThreadedDevCluster
from operator_helpers import PROMOTED_ROLLOUT
from webhooks import loopback_receivers

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl missing: run `make tools`")
Obj = dict[str, object]
FP8_ARGS = ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]


def requests_to_target(cluster: ThreadedDevCluster, ns: str) -> list[tuple[str, str]]:
    """(method, user agent) of every request to the target Deployment itself (not its status) so far."""
    path = f"/apis/apps/v1/namespaces/{ns}/deployments/llama"
    made = cluster.call(lambda: list(cluster.cluster.api))
    return [(r.method.value.upper(), r.headers.get("User-Agent", "")) for r in made if r.url.path == path]


def operator_reads(cluster: ThreadedDevCluster, ns: str) -> int:
    return sum(1 for method, agent in requests_to_target(cluster, ns) if method == "GET" and "kvpolicy" in agent)


def test_a_gitops_revert_is_drift_and_is_gated_again_a_replicas_change_is_not(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    fixed_image_runner: None,
) -> None:
    ns = devcluster_namespace
    manifest = yaml.safe_dump(target(ns))
    kubectl(devcluster, "apply", "-f", "-", stdin=manifest)  # as a GitOps tool creates it
    with operator():
        devcluster.create(policy(ns))
        promoted = wait_phase(devcluster, ns, {"Promoted"})
        first = promoted["status"]["rolloutId"]

        # Scaling (by hand, or an HPA) is not drift.
        kubectl(devcluster, "scale", "deployment", "llama", "--replicas", "2", "-n", ns)
        reads = operator_reads(devcluster, ns)
        wait_until(lambda: operator_reads(devcluster, ns) >= reads + 2, "two more looks at the target", timeout=30)
        steady = devcluster.get(*KVP, "llama-fp8", ns)["status"]
        assert steady["phase"] == "Promoted" and steady["rolloutId"] == first
        assert {c["type"]: c["reason"] for c in steady["conditions"]}["Drifted"] == "InSync"
        assert "TargetDrifted" not in event_reasons(devcluster, ns)

        # A sync of the manifest in Git puts the BF16 image and arguments back: drift, planned and gated again.
        kubectl(devcluster, "apply", "-f", "-", stdin=manifest)
        rerun = wait_until(
            lambda: (found := devcluster.get(*KVP, "llama-fp8", ns))["status"].get("rolloutId") != first and found,
            "a second rollout",
            timeout=30,
        )
        drifted = {c["type"]: c for c in rerun["status"]["conditions"]}["Drifted"]
        assert drifted["status"] == "True" and drifted["reason"] == "TargetDrifted"
        assert f"Image: {PATCHED_IMAGE} -> {TARGET_IMAGE}" in drifted["message"]
        done = wait_phase(devcluster, ns, {"Promoted", "RolledBack"})
        wait_until(
            lambda: (
                {c["type"]: c["status"] for c in devcluster.get(*KVP, "llama-fp8", ns)["status"]["conditions"]}[
                    "Drifted"
                ]
                == "False"
            ),
            "Drifted to clear once the target runs the decision again",
            timeout=30,
        )
        # The status is written before the pass's events are posted: wait for the event too.
        wait_until(lambda: "InSync" in event_reasons(devcluster, ns), "the InSync event", timeout=30)
    assert done["status"]["phase"] == "Promoted", done["status"]
    assert done["status"]["accuracy"]["job"] == "llama-fp8-accuracy-g1r2", "the gates ran again"
    assert devcluster.find("batch/v1", "Job", "llama-fp8-accuracy-g1r2", ns) is not None
    deployed = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert deployed["image"] == PATCHED_IMAGE and deployed["args"][-4:] == FP8_ARGS
    reasons = event_reasons(devcluster, ns)
    assert reasons.count("TargetDrifted") == 1 and "InSync" in reasons


def test_advisory_completes_a_rollout_without_one_write_to_the_target(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    fixed_image_runner: None,
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    created = devcluster.get("apps/v1", "Deployment", "llama", ns)
    with operator():
        devcluster.create(policy(ns, **{"rollout.applyMode": "Advisory"}))
        advised = wait_until(
            lambda: (found := devcluster.get(*KVP, "llama-fp8", ns)).get("status", {}).get("advice") and found,
            "the advice",
            timeout=90,
        )
        assert advised["status"]["phase"] == "Promoting"
        assert devcluster.list("apps/v1", "Deployment", ns, "kvpolicy.dev/role=canary") == [], "GPUs freed"
        untouched = devcluster.get("apps/v1", "Deployment", "llama", ns)
        assert untouched["metadata"]["generation"] == created["metadata"]["generation"]
        assert [m for m, _ in requests_to_target(devcluster, ns) if m != "GET"] == []
        # The GitOps repository takes the change; its sync applies it (here: kubectl, the advised patch).
        advice = advised["status"]["advice"]
        kubectl(devcluster, "patch", "deployment", "llama", "-n", ns, "--type", "strategic", "-p",
                advice["strategicMergePatch"])  # fmt: skip
        done = wait_phase(devcluster, ns, {"Promoted"})
    assert done["status"]["decision"]["reason"] == "Adopted"
    deployed = container(devcluster.get("apps/v1", "Deployment", "llama", ns))
    assert deployed["image"] == PATCHED_IMAGE and deployed["args"][-4:] == FP8_ARGS
    pods = ready_pods(devcluster, ns, "app=llama")
    assert pods and all(container(pod)["args"] == deployed["args"] for pod in pods), "Promoted once the pods run it"
    writes = [(m, agent) for m, agent in requests_to_target(devcluster, ns) if m != "GET"]
    assert len(writes) == 1 and writes[0][1].startswith("kubectl/"), writes
    assert "ChangeAdvised" in event_reasons(devcluster, ns)


def secret(ns: str, name: str, url: str) -> Obj:
    data = {"url": base64.b64encode(url.encode()).decode()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "data": data}


def test_notifications_reach_a_working_receiver_for_every_phase_change_and_failing_ones_change_nothing(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    fixed_image_runner: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = devcluster_namespace
    token = "hook-T0KEN-3f9a"
    monkeypatch.setenv("KVPOLICY_NOTIFY_ATTEMPTS", "2")
    monkeypatch.setenv("KVPOLICY_NOTIFY_TIMEOUT_SECONDS", "1")
    devcluster.create(target(ns))
    receivers = [
        {"name": "ops", "urlSecretRef": {"name": "ok", "key": "url"}},
        {"name": "broken", "format": "Slack", "urlSecretRef": {"name": "fail", "key": "url"}},
        {"name": "stuck", "format": "Teams", "urlSecretRef": {"name": "hang", "key": "url"}},
    ]
    with loopback_receivers() as hooks:
        for kind in ("ok", "fail", "hang"):
            devcluster.create(secret(ns, kind, f"{hooks.url}/{kind}/{token}"))
        with operator():
            devcluster.create(policy(ns, notifications=receivers))
            done = wait_phase(devcluster, ns, {"Promoted", "RolledBack"})
            wait_until(lambda: any(r.body["data"]["phase"] == "Promoted" for r in hooks.of("ok")), "the last notice")
            wait_until(lambda: event_reasons(devcluster, ns).count("NotificationFailed") == 2, "both failures")
    assert done["status"]["phase"] == "Promoted", done["status"]
    events = [r.body for r in hooks.of("ok")]
    changes = [(e["data"]["previousPhase"], e["data"]["phase"]) for e in events if e["type"].endswith("phase.changed")]
    assert changes == PROMOTED_ROLLOUT
    decided = [e for e in events if e["type"] == "dev.kvpolicy.rollout.decided"]
    assert [e["data"]["decision"]["reason"] for e in decided] == ["GatesPassed"]
    assert {e["data"]["rolloutId"] for e in events} == {done["status"]["rolloutId"]}
    assert len({e["id"] for e in events}) == len(events)
    assert hooks.of("fail") and hooks.of("hang"), "the failing receivers were tried"
    assert hooks.of("fail")[0].body["text"].startswith("*KVPolicy")
    assert hooks.of("hang")[0].body["attachments"][0]["content"]["type"] == "AdaptiveCard"
    reasons = event_reasons(devcluster, ns)
    for reason in ("Planned", "CanaryReady", "AccuracyGatePassed", "TrafficJoined", "Promoting", "Promoted"):
        assert reason in reasons
    everything = json.dumps([devcluster.get(*KVP, "llama-fp8", ns), devcluster.list("v1", "Event", ns)])
    assert token not in everything and hooks.url not in everything, "the URL is never in status or events"
