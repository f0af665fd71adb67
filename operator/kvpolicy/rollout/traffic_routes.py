"""traffic InferencePool, as data: the canary's own InferencePool, and the weights of the user's HTTPRoute.

The route is the user's. Unlike a router that owns its route (Flagger's Gateway API router writes the whole spec), the
rollout touches only the backendRefs of the rules that send traffic to the baseline pool: an RFC 6902 patch whose
`test` op holds each such list as it was observed (an edit made since fails the patch; the step observes again),
after recording the lists as they were before the first edit, so that the end of the rollout (promotion, rollback,
a restart) puts them back exactly as written. Weights are percentages of the rule: the baseline's ref gets 100 - w,
the canary pool's ref w. The phase logic that uses these is traffic_router.py.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from kvpolicy.api.v1alpha1 import InferencePoolTraffic, KVPolicyStatus, RouteRuleRecord
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.child_names import child_name
from kvpolicy.rollout.step_types import Action, Delete, Kind, Obj, Observations, Patch

INFERENCE_GROUP = "inference.networking.k8s.io"
POOL_KIND = "InferencePool"
EPP_LABEL = "kvpolicy.dev/endpoint-picker"


class RouteShapeError(ValueError):
    """The route cannot carry the rollout: it does not exist, sends nothing to the pool, or splits a rule that does
    between the pool and other backends (a share of the pool's share is not a weight the route can say)."""


def _names_pool(ref: Mapping[str, Any], pool: str, namespace: str) -> bool:
    return (
        ref.get("group") == INFERENCE_GROUP
        and ref.get("kind") == POOL_KIND
        and ref.get("name") == pool
        and ref.get("namespace", namespace) == namespace
    )


def _rules(route: Mapping[str, Any]) -> list[Obj]:
    rules: list[Obj] = (route.get("spec") or {}).get("rules") or []
    return rules


def original_rules(route: Obj | None, spec: InferencePoolTraffic, namespace: str) -> list[RouteRuleRecord]:
    """The rules of the route that send traffic to the baseline pool, as they are (before any edit)."""
    if route is None:
        raise RouteShapeError(f"HTTPRoute {spec.http_route} not found")
    records = []
    for index, rule in enumerate(_rules(route)):
        refs = list(rule.get("backendRefs") or [])
        if not any(_names_pool(ref, spec.pool, namespace) for ref in refs):
            continue
        if len(refs) != 1:
            raise RouteShapeError(
                f"HTTPRoute {spec.http_route} rule {index} sends traffic to InferencePool {spec.pool} and to "
                f"{len(refs) - 1} other backend(s): the rollout needs rules whose only backend is the pool"
            )
        records.append(RouteRuleRecord(rule=index, backend_refs=refs, filters=rule.get("filters")))
    if not records:
        raise RouteShapeError(f"HTTPRoute {spec.http_route} has no rule sending traffic to InferencePool {spec.pool}")
    return records


def weighted_refs(original: Sequence[Mapping[str, Any]], canary_pool: str, weight: int) -> list[Obj]:
    """A rule's backendRefs with the canary pool at `weight` percent; at 0, the refs exactly as they were."""
    if weight == 0:
        return [dict(ref) for ref in original]
    baseline = {**original[0], "weight": 100 - weight}
    return [baseline, {"group": INFERENCE_GROUP, "kind": POOL_KIND, "name": canary_pool, "weight": weight}]


def mirror_filter(canary_pool: str, percent: int) -> Obj:
    """A RequestMirror filter sending `percent` of a rule's requests to the canary's pool as well."""
    backend = {"group": INFERENCE_GROUP, "kind": POOL_KIND, "name": canary_pool}
    return {"type": "RequestMirror", "requestMirror": {"backendRef": backend, "percent": percent}}


def _list_ops(path: str, current: list[Obj] | None, desired: list[Obj] | None) -> list[Obj]:
    """Ops taking the list at `path` from `current` to `desired` (None: absent), testing a present list first."""
    if current == desired:
        return []
    if current is None:
        return [{"op": "add", "path": path, "value": desired}]
    test = {"op": "test", "path": path, "value": current}
    return [
        test,
        {"op": "remove", "path": path} if desired is None else {"op": "replace", "path": path, "value": desired},
    ]


def route_patch(
    route: Obj, records: Sequence[RouteRuleRecord], canary_pool: str, weight: int, mirror_percent: int | None = None
) -> list[Obj]:
    """The JSON patch taking each recorded rule to `weight` (0: as it was), with the canary's mirror filter added
    when `mirror_percent` is given; empty when the route is there already. Each replaced list is tested first as
    observed."""
    rules = _rules(route)
    ops: list[Obj] = []
    for record in records:
        if record.rule >= len(rules):
            continue  # the rule is gone: nothing of ours is left in it
        rule, path = rules[record.rule], f"/spec/rules/{record.rule}"
        refs = weighted_refs(record.backend_refs, canary_pool, weight)
        ops += _list_ops(f"{path}/backendRefs", rule.get("backendRefs") or [], refs)
        mirror = [mirror_filter(canary_pool, mirror_percent)] if mirror_percent is not None else []
        filters = [*(record.filters or []), *mirror] or None
        ops += _list_ops(f"{path}/filters", rule.get("filters"), filters)
    return ops


def canary_pool(policy: b.PolicyRef, name: str, baseline: Mapping[str, Any], picker: str | None = None) -> Obj:
    """An InferencePool selecting only the canary's pods (their own labels: the canary carries none of the target's),
    with the baseline pool's target ports and protocol. Its endpoint picker: `picker` (the copy of the baseline's,
    with the baseline's port and failure mode), or none, where the gateway balances the pool's endpoints itself
    (endpointPickerRef is optional from GIE v1.6.0)."""
    spec = baseline.get("spec") or {}
    pool_spec: Obj = {
        "selector": {"matchLabels": {**b.policy_labels(policy.name), b.CANARY_LABEL: name}},
        "targetPorts": spec.get("targetPorts") or [{"number": b.DEFAULT_SERVING_PORT}],
    }
    if "appProtocol" in spec:
        pool_spec["appProtocol"] = spec["appProtocol"]
    if picker is not None:
        pool_spec["endpointPickerRef"] = {**spec["endpointPickerRef"], "name": picker}
    return {
        "apiVersion": f"{INFERENCE_GROUP}/v1",
        "kind": POOL_KIND,
        "metadata": policy.metadata(name, b.ROLE_CANARY, {b.CANARY_LABEL: name}),
        "spec": pool_spec,
    }


ROLE_ENDPOINT_PICKER = "endpoint-picker"
POOL_NAME_FLAG = "--pool-name"


def picker_name(policy: str, generation: int, run: int) -> str:
    """The copied endpoint picker's Deployment and Service (a DNS-1035 label, like every child's)."""
    return child_name(policy, f"epp-{b.rollout_suffix(generation, run)}")


def baseline_picker(baseline_pool: Mapping[str, Any], objects: Mapping[str, Obj]) -> tuple[Obj, Obj]:
    """The baseline pool's EPP: the Service its endpointPickerRef names and the Deployment whose pods that Service
    selects, among `objects` ("Service/<name>", "Deployment/<name>")."""
    ref = (baseline_pool.get("spec") or {}).get("endpointPickerRef")
    pool = baseline_pool["metadata"]["name"]
    if not ref or ref.get("kind", "Service") != "Service" or ref.get("group", ""):
        raise RouteShapeError(f"InferencePool {pool} has no endpointPickerRef to a Service: no endpoint picker to copy")
    service = objects.get(f"Service/{ref['name']}")
    if service is None:
        raise RouteShapeError(f"Service {ref['name']} (the endpoint picker of InferencePool {pool}) not found")
    selector = (service.get("spec") or {}).get("selector") or {}
    deployments = [
        obj for key, obj in sorted(objects.items()) if key.startswith("Deployment/") and selector
        and all(b.template_labels(obj).get(k) == v for k, v in selector.items())
    ]  # fmt: skip
    if len(deployments) != 1:
        raise RouteShapeError(
            f"Service {ref['name']} (the endpoint picker of InferencePool {pool}) selects the pods of "
            f"{len(deployments)} Deployments, not one: no endpoint picker to copy"
        )
    return service, deployments[0]


def _for_pool(args: list[str], pool: str) -> list[str]:
    """EPP arguments with `--pool-name` naming `pool` (either `--pool-name X` or `--pool-name=X`)."""
    result = list(args)
    for index, arg in enumerate(result):
        if arg == POOL_NAME_FLAG and index + 1 < len(result):
            result[index + 1] = pool
        elif arg.startswith(f"{POOL_NAME_FLAG}="):
            result[index] = f"{POOL_NAME_FLAG}={pool}"
    return result


def picker_copies(
    policy: b.PolicyRef, name: str, canary_pool_name: str, service: Mapping[str, Any], deployment: Mapping[str, Any]
) -> tuple[Obj, Obj]:
    """The baseline EPP's Deployment (its image, configuration volumes, service account) and Service, under `name`,
    picking for the canary's pool. Its pods carry only the operator's labels: neither the baseline EPP's Service nor
    the canary's pool (which selects the canary's label) selects them."""
    own = {**b.policy_labels(policy.name), b.ROLE_LABEL: ROLE_ENDPOINT_PICKER, EPP_LABEL: name}
    template = copy.deepcopy(deployment["spec"]["template"])
    template.setdefault("metadata", {})["labels"] = own
    for container in template.get("spec", {}).get("containers", []):
        if container.get("args"):
            container["args"] = _for_pool(container["args"], canary_pool_name)
    spec = {**copy.deepcopy(deployment["spec"]), "replicas": 1, "selector": {"matchLabels": own}, "template": template}
    ports = [{k: v for k, v in port.items() if k != "nodePort"} for port in service["spec"].get("ports", [])]
    metadata = policy.metadata(name, ROLE_ENDPOINT_PICKER, {EPP_LABEL: name})
    copied_service = {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
                      "spec": {"selector": own, "ports": ports}}  # fmt: skip
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": copy.deepcopy(metadata), "spec": spec}, (
        copied_service
    )


def pool_selects(pool: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether an InferencePool selects pods with these labels (its selector is matchLabels only)."""
    selector = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def restore_actions(status: KVPolicyStatus, obs: Observations) -> tuple[list[Action], bool]:
    """What puts the route back as written and removes the canary's pool; True when nothing is left to do. The route
    is restored before the pool goes (a route naming a missing pool fails the requests sent to it)."""
    traffic = status.traffic
    if traffic is None:
        return [], True
    actions: list[Action] = []
    if obs.route is not None and traffic.original:
        ops = route_patch(obs.route, traffic.original, traffic.canary_pool, 0)
        if ops:
            actions.append(Patch(Kind.HTTP_ROUTE, traffic.route, ops, patch_type="json"))
    if traffic.canary_pool in obs.pools:
        actions.append(Delete(Kind.INFERENCE_POOL, traffic.canary_pool))
    picker = traffic.endpoint_picker
    if picker is not None and f"Deployment/{picker}" in obs.pickers:
        actions.append(Delete(Kind.DEPLOYMENT, picker))
    if picker is not None and f"Service/{picker}" in obs.pickers:
        actions.append(Delete(Kind.SERVICE, picker))
    return actions, not actions
