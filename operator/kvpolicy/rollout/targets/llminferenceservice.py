"""KServe `serving.kserve.io/v1alpha2` LLMInferenceService: KServe's controller makes the vLLM pods from
`spec.template` (a PodSpec merged into its preset, whose container `main` runs
`vllm serve /mnt/models ... ${VLLM_ADDITIONAL_ARGS} $@`) and routes to them through the routing group.

- Serving flags are read from the container's args and from `VLLM_ADDITIONAL_ARGS`; the plan's KV flags are written
  into `VLLM_ADDITIONAL_ARGS` (the preset's `$@` takes args after its `--`, which a template's own args can replace).
- Parallel sizes come from the arguments and from `spec.parallelism` (which the preset turns into flags).
- The canary is a second LLMInferenceService with no router until the accuracy gate passed; joining the traffic puts
  it in the target's routing group (`spec.router.route.group`) at weight 1 (a gateway may not warm a backend of
  weight 0), and the latency analysis starts only once the target's `status.router.group.members` shows it.
- Retiring the canary takes its weight to 0 and stops it (`serving.kserve.io/stop`) before it is deleted, so the
  group stops sending to it first and its GPUs are freed even if the delete is refused.
- The serving pods are those of KServe's workload labels (`app.kubernetes.io/name`, `.../component`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvpolicy.api.v1alpha1 import KVPolicySpec, Parallelism, Plan, PodTemplateRecord, TargetKind
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.conditions import object_condition
from kvpolicy.rollout.step_types import Action, CustomKind, Patch
from kvpolicy.rollout.targets.base import Obj, ServingTarget

# KServe's labels on an LLMInferenceService's workload pods (pkg/constants, llmisvc singleNodeLabels).
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
WORKLOAD = "llminferenceservice-workload"
STOP_ANNOTATION = "serving.kserve.io/stop"
JOIN_WEIGHT = 1
TEMPLATE = "/spec/template/containers"


def _route(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((obj.get("spec") or {}).get("router") or {}).get("route") or {}


def _with_additional_args(record: PodTemplateRecord, flags: list[str]) -> PodTemplateRecord:
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
    advice_patch_type = "merge"  # custom resources take no strategic merge patch

    def pod_spec(self, target: Mapping[str, Any]) -> Obj:
        spec: Obj = (target.get("spec") or {}).get("template") or {}
        return spec

    def with_plan(self, record: PodTemplateRecord, plan: Plan) -> PodTemplateRecord:
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

    def patch(self, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> list[Obj]:
        index = b.index_in(self.pod_spec(target).get("containers") or [], container, self.describe(target))
        return b.container_ops(f"{TEMPLATE}/{index}", self.container(target, container), desired)

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
        current = self.container(canary, spec.target_ref.container)
        b.set_container(current, self.with_plan(b.container_record(current), plan))
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

    def traffic_confirmed(self, name: str, target: Mapping[str, Any]) -> str | None:
        group = _route(target).get("group")
        if group is None:
            return None  # a target in no routing group: the canary serves synthetic traffic only
        observed = ((target.get("status") or {}).get("router") or {}).get("group") or {}
        for member in observed.get("members") or []:
            if member.get("name") == name and int(member.get("weight") or 0) > 0 and not member.get("stopped"):
                return None
        return f"waiting for routing group {group} to list {name} with a weight (status.router.group.members)"

    def retire(self, name: str) -> list[Action]:
        # Out of the group's traffic first (weight 0) and stopped (KServe scales it to zero, freeing its GPUs even if
        # the delete that follows is refused or held by a finalizer), then gone.
        stop = {"metadata": {"annotations": {STOP_ANNOTATION: "true"}}, "spec": {"router": {"route": {"weight": 0}}}}
        return [Patch(self.object_kind, name, stop), *super().retire(name)]

    def serving_selector(self, target: Mapping[str, Any]) -> dict[str, str]:
        return {NAME_LABEL: str(target["metadata"]["name"]), COMPONENT_LABEL: WORKLOAD}

    def rolled_out(self, target: Mapping[str, Any]) -> bool:
        status = target.get("status") or {}
        generation = int((target.get("metadata") or {}).get("generation") or 0)
        ready = (object_condition(target, "Ready") or {}).get("status") == "True"
        return ready and int(status.get("observedGeneration") or 0) >= generation

    def advice_patch(self, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> Obj:
        """A merge patch replacing the template's containers (a merge patch replaces lists whole)."""
        changed = copy.deepcopy(dict(target))
        b.set_container(self.container(changed, container), desired)
        return {"spec": {"template": {"containers": changed["spec"]["template"]["containers"]}}}
