"""What the rollout needs to know about a kind of serving workload (`ServingTarget`): where its vLLM container is,
how a canary copy of it is made, how promotion and rollback are written into it, and which of its pods serve (the
pods the gates probe and the analysis scrapes). One implementation per kind, registered in `targets/__init__.py`;
the step, the gates, the analysis and the conditions only ever ask this interface.

Everything here is pure: targets are JSON objects as the API server returns them, results are manifests and patches.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvpolicy.api.v1alpha1 import ContainerRecord, KVPolicySpec, Parallelism, Plan, PodTemplateRecord, TargetKind
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.builders import R
from kvpolicy.rollout.step_types import Action, Delete, ObjectKind, Patch, PodView

Obj = dict[str, Any]
Pods = Sequence[PodView]


@dataclass(frozen=True)
class Companion:
    """Another vLLM container of the target holding the same model's KV cache (a worker, a prefill server): it must
    serve the KV cache format of the main container, so it changes with it and is compared with it."""

    spec_path: str  # JSON pointer of its pod spec
    containers: list[Obj]  # that pod spec's containers, as observed
    index: int | None  # its index there; None: the pod spec has no such container yet (a preset gives it)
    name: str  # its name (what a container added for it is called)
    spec_exists: bool = True  # False: not even its pod spec is written (a preset gives it)

    @property
    def container(self) -> Obj | None:
        return self.containers[self.index] if self.index is not None else None


def _own(item: Companion) -> ContainerRecord:
    """A companion's configuration as it is (a container the pod spec lacks yet: nothing of its own)."""
    return ContainerRecord.model_validate(
        b.container_record(item.container or {"image": ""}).model_dump(exclude={"companions"})
    )


def _pointer_value(obj: Obj, path: str) -> Obj:
    """The object at a JSON pointer of plain keys (created empty where missing)."""
    node = obj
    for key in path.strip("/").split("/"):
        node = node.setdefault(key, {})
    return node


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
        """The serving configuration the target asks for now (image, command, args, env of its vLLM container, and
        of its companions); raises TargetShapeError when the container is missing."""
        main = b.container_record(self.container(target, container))
        companions = {role: _own(item) for role, item in self.companions(target, container).items()}
        return main.model_copy(update={"companions": companions or None})

    @abstractmethod
    def container_path(self, target: Mapping[str, Any], container: str | None) -> str:
        """The JSON pointer of the vLLM container in the target."""

    def companions(self, target: Mapping[str, Any], container: str | None) -> dict[str, Companion]:
        """The target's other vLLM containers by role (none unless the kind has them)."""
        return {}

    def patch(self, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> list[Obj]:
        """A JSON patch making the target serve `desired` (promotion, rollback, a BF16 decision), testing first what
        it replaces so a patch computed against an old object fails instead of overwriting an unseen edit."""
        current = self.container(target, container)
        ops = b.container_ops(self.container_path(target, container), current, desired)
        before = b.container_record(current)
        for role, item in self.companions(target, container).items():
            wanted = self._companion_desired(role, item, before, desired)
            if item.index is not None:
                ops += b.container_ops(f"{item.spec_path}/containers/{item.index}", item.containers[item.index], wanted)
                continue
            added: Obj = {"name": item.name}
            b.set_container(added, wanted)
            if wanted.model_dump(exclude_none=True) == {"image": ""}:
                continue  # nothing to give a container the preset makes
            if not item.spec_exists:
                ops.append({"op": "add", "path": item.spec_path, "value": {"containers": [added]}})
            elif item.containers:
                ops.append({"op": "add", "path": f"{item.spec_path}/containers/-", "value": added})
            else:
                ops.append({"op": "add", "path": f"{item.spec_path}/containers", "value": [added]})
        return ops

    def _companion_desired(
        self, role: str, item: Companion, main_before: ContainerRecord, desired: PodTemplateRecord
    ) -> ContainerRecord:
        """What a companion must run for the main container to run `desired`: as recorded in it, or (a record made
        before companions were recorded) its own configuration with the KV flags and image of `desired`."""
        if desired.companions is not None and role in desired.companions:
            return desired.companions[role]
        own = _own(item)
        flags = b.split_kv_flags(b.serving_tokens(desired))[1]
        return b.follow_image(b.with_kv_flags(own, flags, own.image), main_before.image, desired.image)

    def write(self, obj: Obj, container: str | None, desired: PodTemplateRecord) -> None:
        """Make `obj` (a copy of a target, changed in place) serve `desired`, companions included."""
        before = b.container_record(self.container(obj, container))
        companions = self.companions(obj, container)
        b.set_container(self.container(obj, container), desired)
        for role, item in companions.items():
            wanted = self._companion_desired(role, item, before, desired)
            found = item.container
            if found is None:
                found = {"name": item.name}
                _pointer_value(obj, item.spec_path).setdefault("containers", []).append(found)
            b.set_container(found, wanted)

    def with_plan(self, record: PodTemplateRecord, plan: Plan) -> PodTemplateRecord:
        """The serving configuration the plan asks of a target now running `record`: the plan's KV flags (and image)
        in its vLLM container and in every companion."""
        main = self.container_with_plan(record, plan)
        companions = {
            role: self.container_with_plan(item, plan).model_copy(
                update={"image": b.follow_image(item, record.image, main.image).image}
            )
            for role, item in (record.companions or {}).items()
        }
        return main.model_copy(update={"companions": companions or None})

    def container_with_plan(self, record: R, plan: Plan) -> R:
        """One container's configuration under the plan (image aside for a companion: `follow_image`)."""
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

    def traffic_confirmed(self, name: str, target: Mapping[str, Any], weight: int | None = None) -> str | None:
        """None once the traffic the canary `name` joined reaches it (at `weight`, where its share is a weight);
        else what is still awaited. Label-selected traffic reaches the canary's ready pods at once."""
        return None

    def routing_group(self, target: Mapping[str, Any]) -> str | None:
        """The routing group the canary joins by weight (None: the kind has none, or the target is in none)."""
        return None

    def step_weight(self, name: str, target: Mapping[str, Any], share: int) -> int | str | None:
        """The canary's weight that gives it `share` percent of the traffic it joined, or why no weight can (a
        message); None where its share is not a weight the rollout steps (label-selected traffic: its replicas)."""
        return None

    def canary_weight(self, canary: Mapping[str, Any]) -> int:
        """The weight the canary asks for now (kinds whose `step_weight` gives one)."""
        raise NotImplementedError(self.kind)

    def weight_patch(self, weight: int) -> Obj:
        """A merge patch giving the canary `weight` (kinds whose `step_weight` gives one)."""
        raise NotImplementedError(self.kind)

    def retire(self, name: str) -> list[Action]:
        """The writes that remove the canary `name` (after a rollback, a restart; a promotion unless kept)."""
        return [Delete(self.object_kind, name)]

    def keep_after_promotion(self, canary: Mapping[str, Any]) -> list[Action] | None:
        """None: a promoted canary is removed (`retire`). Else it is kept as a way back, its resources freed: the
        writes still needed for that (empty once it is so)."""
        return None

    # --------------------------------------------------------------------------------------------- its pods

    @abstractmethod
    def serving_selector(self, target: Mapping[str, Any]) -> dict[str, str]:
        """Labels selecting the target's serving pods: the baseline the gates probe and the analysis scrapes."""

    def serving_labels(self, target: Mapping[str, Any]) -> dict[str, str]:
        """Labels that tell a copy's serving pods from its other pods, where the kind cannot keep the canary's label
        off those (KServe puts an LLMInferenceService's spec.labels on its workers too)."""
        return {}

    @abstractmethod
    def rolled_out(self, target: Mapping[str, Any]) -> bool:
        """Whether every pod of the target runs its current template and is ready."""

    def advice_patch(self, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> Obj:
        """Advisory mode: the patch a GitOps repository takes (`advice_patch_type` says which kind of patch); here a
        merge patch replacing the containers of every pod spec it changes (a merge patch replaces lists whole)."""
        changed = copy.deepcopy(dict(target))
        self.write(changed, container, desired)
        paths = [self.container_path(target, container).rsplit("/containers/", 1)[0]]
        paths += [item.spec_path for item in self.companions(target, container).values()]
        result: Obj = {}
        for path in paths:
            containers = _pointer_value(copy.deepcopy(changed), path).get("containers")
            _pointer_value(result, path)["containers"] = containers
        return result

    advice_patch_type: ClassVar[str] = "merge"  # custom resources take no strategic merge patch
