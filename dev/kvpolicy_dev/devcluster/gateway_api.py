"""The Gateway API's HTTPRoute and the Inference Extension's InferencePool, as their projects' CRDs define them.

`upstream_crds/` holds the upstream CRD manifests unchanged (tags and commits in its README); applying them to a dev
cluster makes it serve `httproutes.gateway.networking.k8s.io` and `inferencepools.inference.networking.k8s.io` with
their structural schemas, defaults and CEL rules, so an object the operator writes is refused here exactly where a
real API server with those CRDs would refuse it.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Protocol

import yaml

from kvpolicy_dev.devcluster.upstream import UPSTREAM_CRDS


class _Applies(Protocol):
    def apply(self, obj: Any) -> Any: ...


@cache
def _loaded() -> tuple[dict[str, Any], ...]:
    return tuple(yaml.safe_load(path.read_text()) for path in sorted(UPSTREAM_CRDS.glob("*.yaml")))


def gateway_api_crds() -> list[dict[str, Any]]:
    """The upstream CustomResourceDefinitions (fresh copies: the caller may change them)."""
    return [yaml.safe_load(yaml.safe_dump(crd)) for crd in _loaded()]


def install_gateway_api_crds(cluster: _Applies) -> None:
    """Serve HTTPRoute and InferencePool on a dev cluster (a `DevCluster` or a `ThreadedDevCluster`)."""
    for crd in gateway_api_crds():
        cluster.apply(crd)
