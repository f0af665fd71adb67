"""The kinds of serving workload a KVPolicy can target, one module each; adding a kind is its module and its line
here, with its name and apiVersion in `api.v1alpha1` (`TargetKind`, `TARGET_API_VERSIONS`: what the CRD admits)."""

from __future__ import annotations

from kvpolicy.api.v1alpha1 import TargetKind, TargetRef
from kvpolicy.rollout.targets.base import ServingTarget
from kvpolicy.rollout.targets.deployment import DeploymentTarget
from kvpolicy.rollout.targets.leaderworkerset import LeaderWorkerSetTarget
from kvpolicy.rollout.targets.llminferenceservice import LLMInferenceServiceTarget

TARGETS: dict[TargetKind, ServingTarget] = {
    target.kind: target for target in (DeploymentTarget(), LeaderWorkerSetTarget(), LLMInferenceServiceTarget())
}


def target_kind(ref: TargetRef) -> ServingTarget:
    """The implementation for a targetRef (the CRD admits only the kinds registered here)."""
    return TARGETS[ref.kind]
