"""`leaderworkerset.x-k8s.io/v1` LeaderWorkerSet: multi-host vLLM, one leader pod and `size - 1` workers per group.

The leader's pod template (`leaderWorkerTemplate.leaderTemplate`, or the worker template when it has none) holds the
vLLM server the policy names: its configuration is the target's, its pods are the ones that serve (the gates and the
analysis go to the leaders only). The workers change with it: a group whose leader runs an FP8 KV cache beside BF16
workers would pair two cache formats, so every patch and every canary writes the same KV flags into the worker
template's vLLM container too (when the workers run vLLM themselves: `vllm serve --headless`; Ray workers take the
leader's configuration and carry no vLLM flags). The canary is a second LeaderWorkerSet of `rollout.canaryReplicas`
groups of the same size.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvpolicy.api.v1alpha1 import KVPolicySpec, Plan, TargetKind
from kvpolicy.rollout import builders as b
from kvpolicy.rollout import drift
from kvpolicy.rollout.step_types import CustomKind
from kvpolicy.rollout.targets.base import Companion, Obj, ServingTarget

# The labels the LeaderWorkerSet controller gives every pod of a set (sigs.k8s.io/lws api/leaderworkerset/v1).
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_INDEX = "0"
TEMPLATE = "/spec/leaderWorkerTemplate"
WORKER = "worker"


def _templates(target: Mapping[str, Any]) -> Mapping[str, Any]:
    return (target.get("spec") or {}).get("leaderWorkerTemplate") or {}


def _leader_key(target: Mapping[str, Any]) -> str:
    """Where the leader's pod template is: its own, or the worker template it defaults to."""
    return "leaderTemplate" if _templates(target).get("leaderTemplate") else "workerTemplate"


def _runs_vllm(container: Mapping[str, Any]) -> bool:
    """Whether a worker runs a vLLM server of its own (`vllm serve ... --headless`, or the image's `vllm` entrypoint
    given `serve ...`), rather than a Ray worker that the leader configures."""
    tokens = [*(container.get("command") or []), *(container.get("args") or [])]
    markers = ("serve", "--headless")
    return any("vllm" in token or token in markers for token in tokens) or bool(b.split_kv_flags(tokens)[1])


class LeaderWorkerSetTarget(ServingTarget):
    kind = TargetKind.LEADER_WORKER_SET
    object_kind = CustomKind("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet")

    def pod_spec(self, target: Mapping[str, Any]) -> Obj:
        spec: Obj = (_templates(target).get(_leader_key(target)) or {}).get("spec") or {}
        return spec

    def container_path(self, target: Mapping[str, Any], container: str | None) -> str:
        index = b.index_in(self.pod_spec(target).get("containers") or [], container, self.describe(target))
        return f"{TEMPLATE}/{_leader_key(target)}/spec/containers/{index}"

    def companions(self, target: Mapping[str, Any], container: str | None) -> dict[str, Companion]:
        """The worker template's vLLM container (by the leader's container name), when the leader has a template of
        its own and the workers run vLLM."""
        if _leader_key(target) != "leaderTemplate":
            return {}
        containers = ((_templates(target).get("workerTemplate") or {}).get("spec") or {}).get("containers") or []
        name = str(self.container(target, container).get("name"))
        for index, item in enumerate(containers):
            if item.get("name") == name or (container is None and index == 0 and len(containers) == 1):
                if not _runs_vllm(item):
                    return {}
                return {WORKER: Companion(f"{TEMPLATE}/workerTemplate/spec", containers, index, name)}
        return {}

    def canary(self, policy: b.PolicyRef, name: str, target: Mapping[str, Any], spec: KVPolicySpec, plan: Plan) -> Obj:
        container = spec.target_ref.container
        copied = copy.deepcopy(dict(target["spec"]))
        templates = copied["leaderWorkerTemplate"]
        # The leader gets a template of its own even where the target's defaults to the worker's: only the canary's
        # leaders carry the canary label, so its Service and the gates reach the leaders alone.
        templates["leaderTemplate"] = copy.deepcopy(templates.get("leaderTemplate") or templates["workerTemplate"])
        canary: Obj = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": policy.metadata(name, b.ROLE_CANARY, {b.CANARY_LABEL: name}),
            "spec": {
                **copied,
                "replicas": spec.rollout.canary_replicas,
                # One group replaced at a time and none added: relabelling the canary to join needs no second
                # group's GPUs.
                "rolloutStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
                },
            },
        }
        self.write(canary, container, self.with_plan(self.record(canary, container), plan))
        templates["leaderTemplate"].setdefault("metadata", {})["labels"] = b.canary_pod_labels(policy, name, {}, False)
        templates["workerTemplate"].setdefault("metadata", {})["labels"] = policy.labels(b.ROLE_CANARY)
        return canary

    def traffic_labels(self, target: Mapping[str, Any]) -> dict[str, str]:
        labels = (_templates(target).get(_leader_key(target)) or {}).get("metadata", {}).get("labels") or {}
        return dict(labels)

    def join_patch(self, policy: b.PolicyRef, name: str, target: Mapping[str, Any]) -> Obj:
        labels = b.canary_pod_labels(policy, name, self.traffic_labels(target), joined=True)
        return {"spec": {"leaderWorkerTemplate": {"leaderTemplate": {"metadata": {"labels": labels}}}}}

    def serving_selector(self, target: Mapping[str, Any]) -> dict[str, str]:
        return {SET_NAME_LABEL: str(target["metadata"]["name"]), WORKER_INDEX_LABEL: LEADER_INDEX}

    def rolled_out(self, target: Mapping[str, Any]) -> bool:
        # Its status counts groups as a Deployment's counts pods: replicas, updatedReplicas, readyReplicas.
        return drift.rolled_out(target)
