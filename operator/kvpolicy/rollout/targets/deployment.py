"""`apps/v1` Deployment: one pod template, whose vLLM container is the target's; the canary is a second Deployment."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpolicy.api.v1alpha1 import KVPolicySpec, Plan, PodTemplateRecord, TargetKind
from kvpolicy.rollout import builders as b
from kvpolicy.rollout import drift
from kvpolicy.rollout.step_types import Action, Kind, Patch
from kvpolicy.rollout.targets.base import Obj, Pods, ServingTarget


class DeploymentTarget(ServingTarget):
    kind = TargetKind.DEPLOYMENT
    object_kind = Kind.DEPLOYMENT

    def pod_spec(self, target: Mapping[str, Any]) -> Obj:
        spec: Obj = target.get("spec", {}).get("template", {}).get("spec") or {}
        return spec

    advice_patch_type = "strategic merge"

    def container_path(self, target: Mapping[str, Any], container: str | None) -> str:
        return f"/spec/template/spec/containers/{b.container_index(target, container)}"

    def canary(self, policy: b.PolicyRef, name: str, target: Mapping[str, Any], spec: KVPolicySpec, plan: Plan) -> Obj:
        return b.canary_deployment(policy, name, target, spec, plan)

    def traffic_labels(self, target: Mapping[str, Any]) -> dict[str, str]:
        return b.template_labels(target)

    def join_actions(
        self, policy: b.PolicyRef, name: str, canary: Mapping[str, Any], target: Mapping[str, Any], pods: Pods
    ) -> list[Action]:
        """Label the canary's running pods, not its template: a template change would replace the pod that passed
        the accuracy gate with a cold one (a model load of minutes) judged by the latency analysis. The ReplicaSet
        keeps the pods (it selects them by its own labels), and a pod it makes later (a crash, an eviction) is
        labelled as it appears, on the next pass."""
        labels = self.traffic_labels(target)
        return [
            Patch(Kind.POD, pod.name, {"metadata": {"labels": labels}})
            for pod in pods
            if pod.labels.get(b.CANARY_LABEL) == name and any(pod.labels.get(k) != v for k, v in labels.items())
        ]

    def serving_selector(self, target: Mapping[str, Any]) -> dict[str, str]:
        selector: dict[str, str] = target["spec"]["selector"].get("matchLabels") or b.template_labels(target)
        return dict(selector)

    def rolled_out(self, target: Mapping[str, Any]) -> bool:
        return drift.rolled_out(target)

    def advice_patch(self, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> Obj:
        # Strategic merge: containers merge by name, so it fits a Kustomize patch too.
        entry = b.container_entry(self.container(target, container), desired)
        return {"spec": {"template": {"spec": {"containers": [entry]}}}}
