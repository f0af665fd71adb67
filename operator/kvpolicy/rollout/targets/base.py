"""What the rollout needs to know about a kind of serving workload (`ServingTarget`): where its vLLM container is,
how a canary copy of it is made, how promotion and rollback are written into it, and which of its pods serve (the
pods the gates probe and the analysis scrapes). One implementation per kind, registered in `targets/__init__.py`;
the step, the gates, the analysis and the conditions only ever ask this interface.

Everything here is pure: targets are JSON objects as the API server returns them, results are manifests and patches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvpolicy.api.v1alpha1 import KVPolicySpec, Parallelism, Plan, PodTemplateRecord, TargetKind
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.step_types import Action, Delete, ObjectKind, Patch, PodView

Obj = dict[str, Any]
Pods = Sequence[PodView]


class ServingTarget(ABC):
    """One kind of serving workload a KVPolicy's targetRef may name."""

    kind: ClassVar[TargetKind]  # targetRef.kind
    object_kind: ClassVar[ObjectKind]  # what the executor reads and writes the target and its canary as

    # ------------------------------------------------------------------------------------ the serving container

    @abstractmethod
    def pod_spec(self, target: Mapping[str, Any]) -> Obj:
        """The pod spec of the pods that serve (their scheduling constraints and pull secrets are the gate Jobs');
        raises TargetShapeError when the target has none."""

    def record(self, target: Mapping[str, Any], container: str | None) -> PodTemplateRecord:
        """The serving configuration the target asks for now (image, command, args, env of its vLLM container);
        raises TargetShapeError when the container is missing."""
        return b.container_record(self.container(target, container))

    @abstractmethod
    def patch(self, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> list[Obj]:
        """A JSON patch making the target serve `desired` (promotion, rollback, a BF16 decision), testing first what
        it replaces so a patch computed against an old object fails instead of overwriting an unseen edit."""

    def with_plan(self, record: PodTemplateRecord, plan: Plan) -> PodTemplateRecord:
        """The serving configuration the plan asks of a container now running `record`."""
        return b.with_plan(record, plan)

    def parallelism(self, target: Mapping[str, Any], container: str | None) -> Parallelism:
        """The parallel sizes the target serves with (from its vLLM arguments unless the kind says more)."""
        return b.parallelism(self.record(target, container))

    def serving_port(self, target: Mapping[str, Any], container: str | None) -> int:
        return b.serving_port(self.container(target, container))

    def container(self, target: Mapping[str, Any], container: str | None) -> Obj:
        """The vLLM container of the serving pods' template (the first unless targetRef.container names one)."""
        containers: list[Obj] = self.pod_spec(target).get("containers") or []
        return containers[b.index_in(containers, container, self.describe(target))]

    def describe(self, target: Mapping[str, Any]) -> str:
        return f"{self.kind.value} {target['metadata']['name']}"

    # ---------------------------------------------------------------------------------------------- the canary

    @abstractmethod
    def canary(self, policy: b.PolicyRef, name: str, target: Mapping[str, Any], spec: KVPolicySpec, plan: Plan) -> Obj:
        """A copy of the target named `name`, running the plan, whose serving pods carry none of the target's
        traffic labels (no Service of the target's selects them) and carry `kvpolicy.dev/canary: name`."""

    @abstractmethod
    def traffic_labels(self, target: Mapping[str, Any]) -> dict[str, str]:
        """The labels of the target's serving pods that a canary's pods gain when they join the users' traffic."""

    def join_actions(
        self, policy: b.PolicyRef, name: str, canary: Mapping[str, Any], target: Mapping[str, Any], pods: Pods
    ) -> list[Action]:
        """The writes that make the canary `name` serve the users' traffic (ReplicaRatio); none once it does, so a
        later pass adds nothing. `pods`: the canary's pods as observed. By default a merge patch of the canary
        object (`join_patch`), which replaces its pods: a kind that can route its running pods overrides this."""
        if self.is_joined(canary, target):
            return []
        return [Patch(self.object_kind, name, self.join_patch(policy, name, target))]

    def join_patch(self, policy: b.PolicyRef, name: str, target: Mapping[str, Any]) -> Obj:
        """A merge patch giving the canary's serving pods the target's traffic labels (for the default
        `join_actions`; a kind that overrides it has none)."""
        raise NotImplementedError(f"{self.kind.value} joins the traffic through join_actions")

    def is_joined(self, canary: Mapping[str, Any], target: Mapping[str, Any]) -> bool:
        labels = self.traffic_labels(canary)
        return all(labels.get(key) == value for key, value in self.traffic_labels(target).items())

    def traffic_confirmed(self, name: str, target: Mapping[str, Any]) -> str | None:
        """None once the traffic the canary `name` joined reaches it; else what is still awaited. Label-selected
        traffic reaches the canary's ready pods at once."""
        return None

    def retire(self, name: str) -> list[Action]:
        """The writes that remove the canary `name` (after a promotion, a rollback, a restart)."""
        return [Delete(self.object_kind, name)]

    # --------------------------------------------------------------------------------------------- its pods

    @abstractmethod
    def serving_selector(self, target: Mapping[str, Any]) -> dict[str, str]:
        """Labels selecting the target's serving pods: the baseline the gates probe and the analysis scrapes."""

    @abstractmethod
    def rolled_out(self, target: Mapping[str, Any]) -> bool:
        """Whether every pod of the target runs its current template and is ready."""

    @abstractmethod
    def advice_patch(self, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> Obj:
        """Advisory mode: the patch a GitOps repository takes (`advice_patch_type` says which kind of patch)."""

    advice_patch_type: ClassVar[str] = "strategic merge"
