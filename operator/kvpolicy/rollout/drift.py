"""What the target serves, compared with what a policy expects: the one comparison behind both the mid-rollout check
(the target must still be what the rollout was gated on, or the analysis restarts) and drift after a decision (the
target must still run what was decided, or the policy re-evaluates or reports).

The serving configuration is the vLLM container's image, command, arguments and env (`PodTemplateRecord`). Replicas,
labels, annotations (`kubectl rollout restart`), resources and anything an HPA changes are not part of it.

Also here: the change Advisory mode publishes instead of patching, and whether a Deployment's pods all run its
template. Pure: nothing here reads the cluster.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvpolicy.api.v1alpha1 import Advice, ContainerRecord, Difference, PodTemplateRecord
from kvpolicy.rollout import builders as b

if TYPE_CHECKING:  # the target kinds use drift's Deployment helpers
    from kvpolicy.rollout.targets.base import ServingTarget

NONE = "(none)"
# Drift messages stay readable in a condition and an event: long values are shortened to this many characters.
VALUE_LIMIT = 120


def _short(text: str) -> str:
    return text if len(text) <= VALUE_LIMIT else text[: VALUE_LIMIT - 3] + "..."


def _tokens(tokens: Sequence[str] | None) -> str:
    return _short(" ".join(tokens)) if tokens else NONE


def kv_arguments(record: ContainerRecord) -> list[str]:
    """The plan-owned flags of a container's command line, in order (`--kv-cache-dtype fp8 --attention-backend X`)."""
    return b.split_kv_flags(b.serving_tokens(record))[1]


def _env_by_name(env: Sequence[Mapping[str, Any]] | None) -> dict[str, str]:
    return {
        str(item.get("name")): json.dumps({k: v for k, v in item.items() if k != "name"}, sort_keys=True)
        for item in env or []
    }


def _env_value(entry: str) -> str:
    parsed = json.loads(entry)
    if set(parsed) == {"value"}:
        return _short(str(parsed["value"]))
    return _short(entry)


def differences(expected: PodTemplateRecord, observed: PodTemplateRecord) -> list[Difference]:
    """How `observed` differs from `expected`, field by field, its companions' too (a LeaderWorkerSet's worker
    template edited by hand is a changed target as much as its leader's); empty when it serves the same. Env order
    does not matter (the API server keeps it, vLLM does not care); argument order does. A record made before
    companions were recorded (`companions` unset) compares the main container alone."""
    found = _container_differences(expected, observed)
    if expected.companions is None:
        return found
    ours, theirs = expected.companions, observed.companions or {}
    for role in sorted(ours.keys() | theirs.keys()):
        if role not in ours or role not in theirs:
            where = "missing" if role not in theirs else "added"
            found.append(
                Difference(field=f"{role} Container", expected="present" if role in ours else NONE, observed=where)
            )
            continue
        found += [
            item.model_copy(update={"field": f"{role} {item.field}"})
            for item in _container_differences(ours[role], theirs[role])
        ]
    return found


def _container_differences(expected: ContainerRecord, observed: ContainerRecord) -> list[Difference]:
    found: list[Difference] = []
    if expected.image != observed.image:
        found.append(Difference(field="Image", expected=expected.image, observed=observed.image))
    expected_kv, observed_kv = kv_arguments(expected), kv_arguments(observed)
    if expected_kv != observed_kv:
        found.append(Difference(field="KVArguments", expected=_tokens(expected_kv), observed=_tokens(observed_kv)))
    for field, before, after in (
        ("Command", expected.command, observed.command),
        ("Arguments", expected.args, observed.args),
    ):
        plain_before = b.strip_kv_flags(before) if before is not None else None
        plain_after = b.strip_kv_flags(after) if after is not None else None
        if (plain_before or None) != (plain_after or None):
            found.append(Difference(field=field, expected=_tokens(plain_before), observed=_tokens(plain_after)))
    env_before, env_after = _env_by_name(expected.env), _env_by_name(observed.env)
    for name in sorted(env_before.keys() | env_after.keys()):
        before_entry, after_entry = env_before.get(name), env_after.get(name)
        if before_entry != after_entry:
            found.append(
                Difference(
                    field="Env",
                    expected=f"{name}={_env_value(before_entry)}" if before_entry is not None else f"{name} unset",
                    observed=f"{name}={_env_value(after_entry)}" if after_entry is not None else f"{name} unset",
                )
            )
    return found


def describe(found: Sequence[Difference]) -> str:
    """One line for a condition or an event: `Image: a -> b; KVArguments: ... -> ...`."""
    return "; ".join(difference.describe() for difference in found)


def rolled_out(deployment: Mapping[str, Any]) -> bool:
    """Whether every pod of the Deployment runs its current template and is ready (what `kubectl rollout status`
    waits for)."""
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    replicas = int(spec.get("replicas", 1))
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    return (
        int(status.get("observedGeneration") or 0) >= generation
        and int(status.get("updatedReplicas") or 0) >= replicas
        and int(status.get("readyReplicas") or 0) >= replicas
        and int(status.get("replicas") or 0) == int(status.get("updatedReplicas") or 0)
    )


def advice(
    rollout_id: str, kind: ServingTarget, target: Mapping[str, Any], container: str | None, desired: PodTemplateRecord
) -> Advice:
    """The change that makes the target's vLLM container `desired`: the patch a GitOps repository takes (for a
    Deployment a strategic merge patch, which fits a Kustomize patch too), the equivalent JSON patch, and the values
    themselves."""
    before = kind.record(target, container)
    changes = describe(differences(before, desired)) or "nothing: the target already runs it"
    return Advice(
        rollout_id=rollout_id,
        deployment=str(target["metadata"]["name"]),
        container=str(kind.container(target, container).get("name")),
        image=desired.image,
        command=desired.command,
        args=desired.args,
        strategic_merge_patch=json.dumps(kind.advice_patch(target, container, desired), separators=(",", ":")),
        json_patch=json.dumps(kind.patch(target, container, desired), separators=(",", ":")),
        summary=changes,
    )
