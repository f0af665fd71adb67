"""KServe `serving.kserve.io/v1alpha2` LLMInferenceService: KServe's controller makes the vLLM pods from
`spec.template` (a PodSpec merged into its preset, whose container `main` runs
`vllm serve /mnt/models ... ${VLLM_ADDITIONAL_ARGS} $@`) and routes to them through the routing group.

- Serving flags are read from the container's args and from `VLLM_ADDITIONAL_ARGS`; the plan's KV flags are written
  into `VLLM_ADDITIONAL_ARGS` (the preset's `$@` takes args after its `--`, which a template's own args can replace).
- Multi-node and disaggregated services run vLLM in more pod specs, each through the same preset command reading its
  own `VLLM_ADDITIONAL_ARGS`: `spec.worker` (the workers of each leader), `spec.prefill.template` and
  `spec.prefill.worker`. An FP8 decode beside a BF16 prefill or worker would pair two KV-cache formats, so each is a
  companion of `spec.template`'s container: the same KV flags are written into each (a `main` container is added to
  a pod spec that has none: KServe merges containers by name into its preset's), and each is compared for drift.
- Parallel sizes come from the arguments and from `spec.parallelism` (which the preset turns into flags); the canary
  copies the spec, `parallelism`, `worker` and `prefill` included.
- The canary is a second LLMInferenceService with no router until the accuracy gate passed; joining the traffic puts
  it in the target's routing group (`spec.router.route.group`) at weight 1 (a gateway may not warm a backend of
  weight 0); once the target's `status.router.group.members` lists it, it is stepped up to the share each of
  `rollout.routingGroup.steps` names (weights are proportional: the other serving members' weights set the canary's),
  and a step counts, its analysis starts, only once the group's status lists the canary at that step's weight.
- A promoted canary is stopped (`serving.kserve.io/stop`, weight 0), not deleted: KServe takes it to zero pods and out
  of the group's routes, freeing its GPUs, while the configuration the gates passed stays in the group as a way back
  (status.retainedCanary) until the policy's next rollout deletes it (or the policy goes: it owns the canary).
- A rolled back (or restarted) canary is taken to weight 0 and stopped, then deleted: the group stops sending to it
  first, and its GPUs are freed even if the delete is refused.
- The serving pods are those of KServe's workload labels (`app.kubernetes.io/name`, `.../component`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvpolicy.api.v1alpha1 import KVPolicySpec, Parallelism, Plan, TargetKind
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.builders import R
from kvpolicy.rollout.step_types import Action, CustomKind, Patch
from kvpolicy.rollout.targets.base import Companion, Obj, ServingTarget

# KServe's labels on an LLMInferenceService's workload pods (pkg/constants, llmisvc singleNodeLabels).
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
WORKLOAD = "llminferenceservice-workload"
LEADER = "llminferenceservice-workload-leader"  # a multi-node service's leaders (spec.worker set)
# The pod specs besides spec.template whose vLLM container holds the same KV cache, by role: (where, its pod spec).
COMPANION_SPECS = (
    ("worker", ("worker",)),
    ("prefill", ("prefill", "template")),
    ("prefill.worker", ("prefill", "worker")),
)
STOP_ANNOTATION = "serving.kserve.io/stop"
JOIN_WEIGHT = 1
MAX_WEIGHT = 1_000_000  # spec.router.route.weight's maximum
_STOP = {"metadata": {"annotations": {"serving.kserve.io/stop": "true"}}, "spec": {"router": {"route": {"weight": 0}}}}
TEMPLATE = "/spec/template/containers"


def _route(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((obj.get("spec") or {}).get("router") or {}).get("route") or {}


def _members(target: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The routing group's members as KServe's status lists them (name, weight, stopped)."""
    members: list[Mapping[str, Any]] = (((target.get("status") or {}).get("router") or {}).get("group") or {}).get(
        "members"
    ) or []
    return members


def _with_additional_args(record: R, flags: list[str]) -> R:
    """`record` with `flags` appended to VLLM_ADDITIONAL_ARGS (added when the container has none)."""
    env = [dict(item) for item in record.env or []]
    for item in env:
        if item.get("name") == b.ADDITIONAL_ARGS_ENV and isinstance(item.get("value"), str):
            item["value"] = " ".join([*str(item["value"]).split(), *flags])
            break
    else:
        env.append({"name": b.ADDITIONAL_ARGS_ENV, "value": " ".join(flags)})
    return record.model_copy(update={"env": env})


class LLMInferenceServiceTarget(ServingTarget):
    kind = TargetKind.LLM_INFERENCE_SERVICE
    object_kind = CustomKind("serving.kserve.io", "v1alpha2", "llminferenceservices", "LLMInferenceService")

    def pod_spec(self, target: Mapping[str, Any]) -> Obj:
        spec: Obj = (target.get("spec") or {}).get("template") or {}
        return spec

    def container_path(self, target: Mapping[str, Any], container: str | None) -> str:
        return (
            f"{TEMPLATE}/{b.index_in(self.pod_spec(target).get('containers') or [], container, self.describe(target))}"
        )

    def companions(self, target: Mapping[str, Any], container: str | None) -> dict[str, Companion]:
        spec = target.get("spec") or {}
        name = str(self.container(target, container).get("name") or "main")
        found: dict[str, Companion] = {}
        for role, keys in COMPANION_SPECS:
            parent = spec.get(keys[0])
            pod = parent if len(keys) == 1 else (parent or {}).get(keys[1])
            # A worker pod spec makes a workload multi-node: only one the spec names is a companion. A prefill
            # workload's template may be left to the preset, which runs vLLM there all the same.
            if parent is None or (keys[-1] == "worker" and pod is None):
                continue
            containers = list((pod or {}).get("containers") or [])
            index = next((i for i, item in enumerate(containers) if item.get("name") == name), None)
            found[role] = Companion("/spec/" + "/".join(keys), containers, index, name, spec_exists=pod is not None)
        return found

    def container_with_plan(self, record: R, plan: Plan) -> R:
        stripped = b.with_kv_flags(record, [], plan.image or record.image)
        if stripped.args == [] and record.args is None:
            stripped = stripped.model_copy(update={"args": None})
        valued = [item for item in record.env or [] if item.get("name") == b.ADDITIONAL_ARGS_ENV]
        if valued and not isinstance(valued[0].get("value"), str):  # set from a Secret or ConfigMap: use args
            return b.with_plan(record, plan)
        return _with_additional_args(stripped, plan.extra_args)

    def parallelism(self, target: Mapping[str, Any], container: str | None) -> Parallelism:
        sizes = super().parallelism(target, container)
        declared = (target.get("spec") or {}).get("parallelism") or {}
        # The preset passes spec.parallelism.tensor as --tensor-parallel-size before the arguments, which win.
        given = {name: value for name, value in sizes.model_dump().items() if value != 1}
        merged = {
            name: declared[name] for name in ("tensor", "pipeline", "data") if isinstance(declared.get(name), int)
        }
        return Parallelism.model_validate({**merged, **given})

    def canary(self, policy: b.PolicyRef, name: str, target: Mapping[str, Any], spec: KVPolicySpec, plan: Plan) -> Obj:
        copied = copy.deepcopy(dict(target["spec"]))
        copied.pop("router", None)  # no route, so no user traffic before the accuracy gate
        copied.pop("scaling", None)  # replicas instead (the CRD allows one of them)
        copied["replicas"] = spec.rollout.canary_replicas
        copied["labels"] = b.canary_pod_labels(policy, name, {}, joined=False)
        canary: Obj = {
            "apiVersion": "serving.kserve.io/v1alpha2",
            "kind": "LLMInferenceService",
            "metadata": policy.metadata(name, b.ROLE_CANARY, {b.CANARY_LABEL: name}),
            "spec": copied,
        }
        container = spec.target_ref.container
        self.write(canary, container, self.with_plan(self.record(canary, container), plan))
        return canary

    def traffic_labels(self, target: Mapping[str, Any]) -> dict[str, str]:
        # Traffic reaches members of a routing group by the group's routes, not by pod labels.
        return {}

    def join_patch(self, policy: b.PolicyRef, name: str, target: Mapping[str, Any]) -> Obj:
        router = copy.deepcopy(dict((target.get("spec") or {}).get("router") or {}))
        router["route"] = {**dict(_route(target)), "weight": JOIN_WEIGHT}
        return {"spec": {"router": router}}

    def is_joined(self, canary: Mapping[str, Any], target: Mapping[str, Any]) -> bool:
        group = _route(target).get("group")
        return group is None or _route(canary).get("group") == group

    def traffic_confirmed(self, name: str, target: Mapping[str, Any], weight: int | None = None) -> str | None:
        group = _route(target).get("group")
        if group is None:
            return None  # a target in no routing group: the canary serves synthetic traffic only
        for member in _members(target):
            if member.get("name") != name or member.get("stopped"):
                continue
            listed = int(member.get("weight") or 0)
            if listed > 0 and (weight is None or listed == weight):
                return None
        wanted = f"weight {weight}" if weight is not None else "a weight"
        return f"waiting for routing group {group} to list {name} with {wanted} (status.router.group.members)"

    def routing_group(self, target: Mapping[str, Any]) -> str | None:
        group = _route(target).get("group")
        return str(group) if group is not None else None

    def step_weight(self, name: str, target: Mapping[str, Any], share: int) -> int | str | None:
        group = self.routing_group(target)
        if group is None:
            return None
        # Weights are proportional: the canary's share is w / (w + the other serving members' weights).
        others = sum(
            int(m.get("weight") or 0) for m in _members(target) if m.get("name") != name and not m.get("stopped")
        )
        if others <= 0:
            return (
                f"the members of routing group {group} besides {name} have no weight in the target's "
                "status.router.group: any weight would send the canary all of the group's traffic"
            )
        return min(max(-(-others * share // (100 - share)), JOIN_WEIGHT), MAX_WEIGHT)

    def canary_weight(self, canary: Mapping[str, Any]) -> int:
        return int(_route(canary).get("weight") or 0)

    def weight_patch(self, weight: int) -> Obj:
        return {"spec": {"router": {"route": {"weight": weight}}}}

    def retire(self, name: str) -> list[Action]:
        # Out of the group's traffic first (weight 0) and stopped (KServe scales it to zero, freeing its GPUs even if
        # the delete that follows is refused or held by a finalizer), then gone.
        return [Patch(self.object_kind, name, _STOP), *super().retire(name)]

    def keep_after_promotion(self, canary: Mapping[str, Any]) -> list[Action] | None:
        # Stopped, not deleted: KServe scales it to zero and leaves it out of the group's routes (its GPUs freed),
        # while the configuration the gates passed stays at hand, in the group, until the next rollout deletes it.
        stopped = (canary.get("metadata") or {}).get("annotations", {}).get(STOP_ANNOTATION) == "true"
        if stopped and self.canary_weight(canary) == 0:
            return []
        return [Patch(self.object_kind, str(canary["metadata"]["name"]), _STOP)]

    def serving_selector(self, target: Mapping[str, Any]) -> dict[str, str]:
        return {NAME_LABEL: str(target["metadata"]["name"]), **self.serving_labels(target)}

    def serving_labels(self, target: Mapping[str, Any]) -> dict[str, str]:
        # The decode leaders (or single-node pods) serve; prefill pods and workers carry spec.labels too.
        multi_node = "worker" in (target.get("spec") or {})
        return {COMPONENT_LABEL: LEADER if multi_node else WORKLOAD}

    def rolled_out(self, target: Mapping[str, Any]) -> bool:
        status = target.get("status") or {}
        generation = int((target.get("metadata") or {}).get("generation") or 0)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        return ready and int(status.get("observedGeneration") or 0) >= generation
