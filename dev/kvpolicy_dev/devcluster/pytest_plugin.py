"""pytest fixtures exposing the dev cluster: load with `pytest_plugins = ["kvpolicy_dev.devcluster.pytest_plugin"]`.

- `devcluster`: one `ThreadedDevCluster` for the whole session; KUBECONFIG points at it, so kubectl, helm, kopf and
  the kubernetes library all talk to it.
- `devcluster_namespace`: a fresh namespace per test. On teardown it is deleted with everything in it (pod processes
  and objects held by finalizers included), and injected faults, pool capacities, private registries, the container
  runner and the accepted bearer tokens are reset.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import kubernetes.config.kube_config
import pytest

from kvpolicy_dev.devcluster.cluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.runners import SimulatorRunner


@pytest.fixture(scope="session")
def devcluster() -> Iterator[ThreadedDevCluster]:
    with ThreadedDevCluster(runner=SimulatorRunner(time_scale=0.001)) as cluster, pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(cluster.kubeconfig))
        # The kubernetes library reads KUBECONFIG once, at import, into this default; it is imported by now.
        mp.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))
        yield cluster


@pytest.fixture
def devcluster_namespace(devcluster: ThreadedDevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{slug}-{secrets.token_hex(3)}"
    devcluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    runner = devcluster.call(lambda: devcluster.cluster.kubelet.runner)
    try:
        yield name
    finally:
        devcluster.purge_namespace(name)
        devcluster.clear_faults()
        devcluster.accept_tokens(None)
        devcluster.call(devcluster.cluster.reset_pool_capacities)
        devcluster.call(devcluster.cluster.kubelet.private_registries.clear)
        devcluster.set_runner(runner)
