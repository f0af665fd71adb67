"""The operator's rollout with real vLLM in the pods: the kubelet stand-in runs vLLM's CPU build (a tiny random-weight
Llama) for the target, the canary and the promoted target, with exactly the arguments in their pod specs.

What is checked is what vLLM itself reports: the arguments each pod's entrypoint received, and the KV cache each
server says it runs (vllm:cache_config_info). GPU-kernel flags are checked with vLLM's parser and left out on CPU.
Accuracy is not gated here (random weights find no needle; tests/realvllm has the accuracy gate's own test), so the
decision rests on the latency probe Job, run against the two real servers with limits CPU noise cannot break.

The promoted rollout runs authenticated end to end: every vLLM server wants an API key (VLLM_API_KEY from a Secret),
the probe Job gets it from `spec.vllmAuth`'s Secret, and the operator checks what the canary serves through a real
Prometheus (scraping the pods) behind a TLS reverse proxy that wants a bearer token, a tenant header and a client
certificate, all from `gates.latency.prometheusAuth`'s Secrets. Afterwards no secret value may appear in any Job spec,
the status, an event, the operator's log or the gate Jobs' logs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
from analysis.live_fleet import PROMETHEUS, PrometheusServer
from auth_proxy import AuthProxy, Pki, prometheus_auth_spec
from e2e_helpers import KVP, OperatorFactory, container, event_reasons, vllm_serve_target, wait_until
from kvpolicy.rollout.builders import API_KEY_ENV
from kvpolicy_dev.devcluster import ThreadedDevCluster
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmRunner
from kvpolicy_dev.devcluster.pytest_plugin import REAL_VLLM_STARTUP_SECONDS
from kvpolicy_dev.devcluster.runners import EntrypointQuirk
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.realvllm

MODEL = "tiny"
MODEL_LEN = 4096
TARGET_IMAGE = "vllm/vllm-openai:v0.32.0"
PATCHED_IMAGE = "vllm-fp8-twolevel:test"
PLAN_ARGS = ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window", "--attention-backend",
             "FLASH_ATTN"]  # fmt: skip
# Real vLLM starts in tens of seconds on two cores, more when the machine is busy.
SERVER_START_SECONDS = 400.0
API_KEY = "vllm-key-3c1d9a7e-do-not-print"
BEARER = "prom-bearer-b82f6e10-do-not-print"
TENANT = {"X-Scope-OrgID": "team-llm"}


def target(namespace: str, api_key_secret: str | None = None) -> dict[str, Any]:
    # vLLM reads its --api-key from VLLM_API_KEY too.
    key = {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": api_key_secret, "key": "token"}}}
    return vllm_serve_target(namespace, MODEL, TARGET_IMAGE, [MODEL, "--max-model-len", str(MODEL_LEN)],
                             [key] if api_key_secret else [])  # fmt: skip


def policy(namespace: str, auth: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "targetRef": {"name": MODEL},
        # The spec describes a model with one 128-token sliding-window layer of two, so the plan keeps it in BF16;
        # vLLM accepts `--kv-cache-dtype-skip-layers sliding_window` for the tiny Llama too (it has none to skip).
        "model": {
            "servedModelName": MODEL,
            "headDim": 64,
            "numLayers": 2,
            "maxModelLen": MODEL_LEN,
            "slidingWindow": {"count": 1, "windowTokens": 128},
        },
        "workload": {"maxContextTokens": MODEL_LEN, "decodeBreakEvenTokens": 2048},
        "images": {"fp8Patched": PATCHED_IMAGE},
        "gates": {
            "accuracy": {"enabled": False},
            "gpuPreflight": {"enabled": False},
            "latency": {"ttftMaxRatio": "100", "itlMaxRatio": "100"},
        },
        "rollout": {"traffic": "Synthetic", "bakeSeconds": 0, "progressDeadlineSeconds": int(SERVER_START_SECONDS)},
    }
    if auth is not None:
        spec["vllmAuth"] = auth["vllmAuth"]
        spec["gates"]["latency"].update(auth["latency"])
    return {
        "apiVersion": KVP[0],
        "kind": KVP[1],
        "metadata": {"name": "tiny-fp8", "namespace": namespace},
        "spec": spec,
    }


def ready_pod(
    cluster: ThreadedDevCluster, namespace: str, selector: str, where: Callable[[dict[str, Any]], bool]
) -> dict[str, Any] | None:
    """The first Ready pod matching `selector` and `where`, or None."""
    for pod in cluster.list("v1", "Pod", namespace, selector):
        conditions = pod.get("status", {}).get("conditions", [])
        if where(pod) and any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            return pod
    return None


def served_cache(pod: dict[str, Any]) -> tuple[str, str]:
    """(cache_dtype, kv_cache_dtype_skip_layers) from the pod's own vllm:cache_config_info."""
    with urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    (sample,) = families["vllm:cache_config_info"].samples
    return sample.labels["cache_dtype"], sample.labels["kv_cache_dtype_skip_layers"]


def pod_log(cluster: ThreadedDevCluster, namespace: str, pod: dict[str, Any]) -> str:
    return cluster.call(cluster.cluster.kubelet.read_log, namespace, pod["metadata"]["name"])


def wait_ready_pod(cluster: ThreadedDevCluster, namespace: str, selector: str, name: str,
                   where: Callable[[dict[str, Any]], bool] = lambda pod: True) -> dict[str, Any]:  # fmt: skip
    started = time.monotonic()
    pod = wait_until(lambda: ready_pod(cluster, namespace, selector, where), name, SERVER_START_SECONDS)
    REAL_VLLM_STARTUP_SECONDS[name] = time.monotonic() - started
    return pod


def secret(namespace: str, name: str, data: dict[str, str]) -> dict[str, Any]:
    encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": encoded}


class LoopThread:
    """An asyncio loop in a thread, for the async proxy beside a synchronous test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@dataclass(frozen=True)
class ScrapedPod:
    pod: str
    port: int


class PodDiscovery:
    """Prometheus' file_sd targets: every Ready pod of the namespace under its namespace and pod labels, as
    kubernetes_sd with the usual relabeling gives them; rewritten twice a second while the test runs."""

    def __init__(self, cluster: ThreadedDevCluster, namespace: str, path: Path) -> None:
        self.cluster, self.namespace, self.path = cluster, namespace, path
        self._stop = threading.Event()
        self.write()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def write(self) -> int:
        groups = [
            {
                "targets": [f"{pod['status']['podIP']}:8000"],
                "labels": {"namespace": self.namespace, "pod": pod["metadata"]["name"]},
            }
            for pod in self.cluster.list("v1", "Pod", self.namespace)
            if container(pod).get("ports")  # the vLLM pods: target and canary, not the gate Jobs'
            and any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))
        ]
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(groups))
        partial.replace(self.path)
        return len(groups)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.write()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki.create(tmp_path / "pki")


def answers(url: str, api_key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urlopen(Request(url, headers=headers), timeout=10) as response:
            return int(response.status)
    except HTTPError as error:
        return error.code


def test_rollout_with_real_vllm_runs_the_plans_arguments_and_promotes(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    cpu_vllm_model: Path,
    pki: Pki,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed: `make prometheus` installs Debian's package")
    ns = devcluster_namespace
    client_key = pki.client_key.read_text()
    devcluster.create(secret(ns, "vllm-api-key", {"token": API_KEY}))
    devcluster.create(secret(ns, "prometheus-reader", {"token": BEARER}))
    tls = {"ca.crt": pki.ca_cert.read_text(), "tls.crt": pki.client_cert.read_text(), "tls.key": client_key}
    devcluster.create(secret(ns, "prometheus-client", tls))
    devcluster.set_runner(RealVllmRunner(cpu_vllm_model))
    devcluster.create(target(ns, api_key_secret="vllm-api-key"))
    bf16_target = wait_ready_pod(devcluster, ns, "app=tiny", "rollout target (BF16)")
    assert served_cache(bf16_target) == ("auto", "[]")
    # vLLM 0.32's --api-key guards /v1/* only: /metrics (what the operator and Prometheus read) stays open.
    base = f"http://{bf16_target['status']['podIP']}:8000"
    assert answers(f"{base}/v1/models") == 401
    assert answers(f"{base}/v1/models", API_KEY) == 200
    assert (answers(f"{base}/metrics"), answers(f"{base}/health")) == (200, 200)

    discovery = PodDiscovery(devcluster, ns, tmp_path / "pods.json")
    scrape = [{"job_name": "pods", "file_sd_configs": [{"files": [str(discovery.path)], "refresh_interval": "1s"}]}]
    prometheus = PrometheusServer([ScrapedPod(bf16_target["metadata"]["name"], 8000)], ns, scrape_configs=scrape)
    loop = LoopThread()
    proxy = AuthProxy(prometheus.url, pki, f"Bearer {BEARER}", TENANT)
    auth = {
        "vllmAuth": {"apiKeySecretRef": {"name": "vllm-api-key", "key": "token"}},
        "latency": {
            "provider": "Prometheus",
            "prometheusURL": loop.run(proxy.start()),
            "prometheusAuth": prometheus_auth_spec(TENANT),
        },
    }
    try:
        with caplog.at_level(logging.DEBUG), operator() as runner:
            devcluster.create(policy(ns, auth))
            canary = wait_ready_pod(devcluster, ns, "kvpolicy.dev/role=canary", "rollout canary (FP8)")
            canary_spec = container(canary)
            assert canary_spec["image"] == PATCHED_IMAGE
            assert canary_spec["args"] == [MODEL, "--max-model-len", str(MODEL_LEN), *PLAN_ARGS]
            log = pod_log(devcluster, ns, canary)
            assert f"the container runs: vllm serve {' '.join(canary_spec['args'])}\n" in log, log[-3000:]
            assert "--attention-backend FLASH_ATTN: accepted by vLLM's parser and validator; left out on CPU" in log
            assert served_cache(canary) == ("fp8", "['sliding_window']")
            assert answers(f"http://{canary['status']['podIP']}:8000/v1/models") == 401, "the canary wants the key too"

            def decided() -> dict[str, Any] | None:
                found = devcluster.find(*KVP, "tiny-fp8", ns) or {}
                return found if found.get("status", {}).get("phase") in ("Promoted", "RolledBack", "HeldBF16") else None

            done = wait_until(decided, "a decision", SERVER_START_SECONDS)
            assert done["status"]["phase"] == "Promoted", done["status"]
            # The operator read the same through Prometheus, behind the proxy, before any gate.
            verified = {c["type"]: c for c in done["status"]["conditions"]}["CanaryConfigVerified"]
            assert (verified["status"], verified["reason"]) == ("True", "ServedAsPlanned"), verified
            assert proxy.forwarded > 0, "the operator's queries went through the authenticating proxy"
            assert done["status"]["canary"]["servedKvCacheDtype"] == "fp8"
            assert done["status"]["canary"]["servedSkipLayers"] == ["sliding_window"]
            assert done["status"]["latency"]["probe"]["verdict"] == "Pass", done["status"]["latency"]
            promoted = container(devcluster.get("apps/v1", "Deployment", MODEL, ns))
            assert promoted["image"] == PATCHED_IMAGE and promoted["args"][-len(PLAN_ARGS) :] == PLAN_ARGS
            new_target = wait_ready_pod(devcluster, ns, "app=tiny,!kvpolicy.dev/role", "promoted target (FP8)",
                                        lambda pod: container(pod)["image"] == PATCHED_IMAGE)  # fmt: skip
            assert served_cache(new_target) == ("fp8", "['sliding_window']")
            jobs = devcluster.list("batch/v1", "Job", ns)
            gate_pods = devcluster.list("v1", "Pod", ns, "kvpolicy.dev/role=gate")
            gate_logs = [pod_log(devcluster, ns, pod) for pod in gate_pods]
            status = devcluster.find(*KVP, "tiny-fp8", ns)
            events = devcluster.list("v1", "Event", ns)
    finally:
        loop.run(proxy.stop())
        loop.stop()
        discovery.stop()
        prometheus.stop()
    assert "LatencyAnalysisStarted" in event_reasons(devcluster, ns, "tiny-fp8")
    (probe,) = [job for job in jobs if job["metadata"]["name"].startswith("tiny-fp8-latency")]
    env = {e["name"]: e for e in probe["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[API_KEY_ENV]["valueFrom"] == {"secretKeyRef": {"name": "vllm-api-key", "key": "token"}}
    assert gate_logs and all(gate_logs), "the gate Jobs' logs were read"
    operator_log = runner.output + "\n".join(record.getMessage() for record in caplog.records)
    assert "tiny-fp8" in operator_log, "the operator's log was captured"
    everything = json.dumps([jobs, status, events]) + operator_log + "".join(gate_logs)
    key_body = "".join(client_key.strip().splitlines()[1:-1])[:40]
    for value in (API_KEY, BEARER, key_body, *(base64.b64encode(v.encode()).decode() for v in (API_KEY, BEARER))):
        assert value not in everything, "a secret value leaked into a Job spec, the status, an event or a log"


def test_a_canary_whose_entrypoint_drops_the_kv_dtype_is_rolled_back_with_planned_and_served(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, operator: OperatorFactory, cpu_vllm_model: Path
) -> None:
    ns = devcluster_namespace
    lossy = {PATCHED_IMAGE: EntrypointQuirk(drop=("--kv-cache-dtype",))}
    devcluster.set_runner(RealVllmRunner(cpu_vllm_model, quirks=lossy))
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns))  # the target and the canary start together

        def decided() -> dict[str, Any] | None:
            found = devcluster.find(*KVP, "tiny-fp8", ns) or {}
            return found if found.get("status", {}).get("phase") in ("Promoted", "RolledBack", "HeldBF16") else None

        done = wait_until(decided, "a decision", 2 * SERVER_START_SECONDS)
    status = done["status"]
    assert status["phase"] == "RolledBack", status
    decision = status["decision"]
    assert decision["reason"] == "CanaryConfigMismatch", decision
    assert "planned KV cache dtype fp8, skip layers [sliding_window]" in decision["message"], decision
    assert "serves KV cache dtype auto, skip layers [sliding_window]" in decision["message"], decision
    verified = {c["type"]: c for c in status["conditions"]}["CanaryConfigVerified"]
    assert (verified["status"], verified["reason"]) == ("False", "CanaryConfigMismatch"), verified
    assert "latency" not in status or not (status["latency"] or {}).get("probe"), "no gate ran"
