"""The target abstraction: the step, the gates and the conditions reach the target only through its kind's
implementation (rollout/targets/), one per kind the CRD admits."""

from __future__ import annotations

import pytest
from fake_kube import FakeKubeApi
from kvpolicy.api.v1alpha1 import TARGET_API_VERSIONS, TargetKind, TargetRef
from kvpolicy.kube.api import Resource
from kvpolicy.kube.executor import apply_actions
from kvpolicy.rollout import targets
from kvpolicy.rollout.step_types import Create, CustomKind, Delete, Kind, Patch
from kvpolicy.rollout.targets.deployment import DeploymentTarget
from operator_helpers import NAMESPACE, Driver, World, make_policy
from pydantic import ValidationError

SERVER = CustomKind(group="example.dev", version="v1", plural="servers", kind="Server")


class ServerTarget(DeploymentTarget):
    """A Deployment-shaped custom resource: what a new kind's module looks like to the step."""

    object_kind = SERVER


def test_every_kind_the_crd_admits_has_one_implementation_registered() -> None:
    assert set(targets.TARGETS) == set(TargetKind) == set(TARGET_API_VERSIONS)
    for kind, implementation in targets.TARGETS.items():
        assert implementation.kind is kind
        ref = TargetRef(kind=kind, api_version=TARGET_API_VERSIONS[kind], name="llama")
        assert targets.target_kind(ref) is implementation


def test_a_targetref_whose_api_version_is_not_its_kinds_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError, match=r"targetRef.apiVersion must be the kind's: .*\(Deployment apps/v2\)"):
        TargetRef.model_validate({"kind": "Deployment", "apiVersion": "apps/v2", "name": "llama"})
    with pytest.raises(ValidationError, match="kind"):
        TargetRef.model_validate({"kind": "StatefulSet", "apiVersion": "apps/v1", "name": "llama"})


@pytest.mark.parametrize("outcome", ["Promoted", "RolledBack"])
def test_the_step_writes_the_target_and_its_canary_only_as_the_targets_kind(
    monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    monkeypatch.setitem(targets.TARGETS, TargetKind.DEPLOYMENT, ServerTarget())
    spec = {"gates.accuracy.enabled": False, "rollout.traffic": "ReplicaRatio"}
    driver = Driver(make_policy(**spec), World(kind=ServerTarget()))
    driver.tick()
    driver.world.canary_up()
    driver.tick()  # ready: the canary joins the target's traffic (its running pods are labelled)
    if outcome == "RolledBack":
        driver.edit({"rollout.abort": True})
    for _ in range(4):
        driver.world.canary_up()
        driver.tick(10)
    assert driver.phase == outcome
    actions = [action for result in driver.results for action in result.actions]
    workloads = [action for action in actions if action.kind not in (Kind.SERVICE, Kind.JOB, Kind.POD)]
    assert workloads and all(action.kind == SERVER for action in workloads), workloads
    assert Create in {type(action) for action in workloads} and Delete in {type(action) for action in workloads}
    target_patches = [action for action in workloads if isinstance(action, Patch) and action.name == "llama"]
    assert bool(target_patches) == (outcome == "Promoted")
    assert "Server/llama-fp8-canary-g1" in driver.world.creates


async def test_the_executor_writes_a_custom_kind_through_its_group_and_plural() -> None:
    api = FakeKubeApi()
    body = {"apiVersion": "example.dev/v1", "kind": "Server", "metadata": {"name": "canary"}}
    assert await apply_actions(api, NAMESPACE, [Create(SERVER, body)]) == []
    assert await api.get(Resource("example.dev", "v1", "servers"), NAMESPACE, "canary") is not None
    assert await apply_actions(api, NAMESPACE, [Delete(SERVER, "canary")]) == []
    assert await api.get(Resource("example.dev", "v1", "servers"), NAMESPACE, "canary") is None
