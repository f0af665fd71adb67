"""The canary's share of the traffic measured on a real data path: the session's real vLLM CPU servers (FP8 as the
canary's pool, BF16 as the baseline's) behind Debian's nginx configured from the HTTPRoute the operator writes at each
step (traffic_routes.weighted_refs on a user's route), the servers' own vllm:request_success_total read by a real
Prometheus through the Prometheus provider, and judged by the operator's own rule (traffic_share.judge).

Cheap on purpose: a one-word prompt, one generated token, 40 requests per weight, one at a time."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from analysis.live_fleet import PrometheusServer, drive_load, wait_until
from kvpolicy.analysis.model import SideSelector
from kvpolicy.analysis.prometheus import PrometheusProvider
from kvpolicy.api.reasons import Reason
from kvpolicy.api.v1alpha1 import ConditionStatus
from kvpolicy.rollout.traffic_routes import weighted_refs
from kvpolicy.rollout.traffic_share import judge
from nginx_gateway import NGINX, NginxGateway
from realvllm_helpers import BASELINE_POD, CANARY_POD, NAMESPACE, SERVED_MODEL, RealPair

pytestmark = pytest.mark.realvllm

REQUESTS = 40
POOL_REF = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama", "weight": 1}
CANARY_POOL = "llama-fp8-canary-g1"


def user_route() -> dict[str, Any]:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "llm"},
            "spec": {"parentRefs": [{"name": "gateway"}], "rules": [{"backendRefs": [dict(POOL_REF)]}]}}  # fmt: skip


def route_at(weight: int) -> dict[str, Any]:
    """The user's route as the operator leaves it at a step of `weight` percent."""
    route = copy.deepcopy(user_route())
    route["spec"]["rules"][0]["backendRefs"] = weighted_refs([POOL_REF], CANARY_POOL, weight)
    return route


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxGateway]:
    if NGINX is None:
        pytest.skip("nginx is not installed: `make nginx` installs Debian's nginx-light")
    nginx = NginxGateway(Path(tmp_path_factory.mktemp("nginx")))
    try:
        yield nginx
    finally:
        nginx.stop()


def finished(prometheus: PrometheusServer, pod: str) -> float:
    return prometheus.query_value(f'sum(vllm:request_success_total{{pod="{pod}"}})') or 0.0


async def measure(gateway: NginxGateway, prometheus: PrometheusServer, requests: int) -> tuple[float, float]:
    """Send the requests through the gateway; each side's finished requests in a window that holds only them."""
    before = {pod: finished(prometheus, pod) for pod in (CANARY_POD, BASELINE_POD)}
    start = time.monotonic()
    await asyncio.sleep(1.0)  # a flat sample of each counter before the requests, inside the window
    await drive_load(gateway.url, requests, concurrency=1, max_tokens=1, prompt="Hello", model=SERVED_MODEL)
    wait_until(
        lambda: sum(finished(prometheus, pod) - before[pod] for pod in before) >= requests,
        30,
        "Prometheus to see every request",
    )
    await asyncio.sleep(1.0)  # and a flat one after
    window = time.monotonic() - start + 0.5
    async with PrometheusProvider(prometheus.url) as provider:
        sides = [
            await provider.latency_snapshot(SideSelector(role, NAMESPACE, pods=(pod,)), window, (0.5,))
            for role, pod in (("canary", CANARY_POD), ("baseline", BASELINE_POD))
        ]
    canary, baseline = (side.finished_requests for side in sides)
    assert canary is not None and baseline is not None
    return canary, baseline


@pytest.mark.parametrize("weight", [10, 50, 100])
async def test_the_measured_share_is_the_routes_weight(
    real_vllm: RealPair, prometheus: PrometheusServer, gateway: NginxGateway, weight: int
) -> None:
    servers = gateway.configure(route_at(weight), {"llama": [real_vllm.bf16.url], CANARY_POOL: [real_vllm.fp8.url]})
    assert sum(w for _, w in servers) == 100
    canary, baseline = await measure(gateway, prometheus, REQUESTS)
    share = 100.0 * canary / (canary + baseline)
    print(f"route at {weight}%: canary served {canary:.1f}, baseline {baseline:.1f} requests: {share:.2f}%")
    assert share == pytest.approx(weight, abs=3.0), (canary, baseline)
    status, reason, message = judge(float(weight), canary, baseline)
    assert (status, reason) == (ConditionStatus.TRUE, Reason.SHARE_AS_INTENDED), message


async def test_a_gateway_that_does_not_follow_the_route_sets_the_skew_condition(
    real_vllm: RealPair, prometheus: PrometheusServer, gateway: NginxGateway
) -> None:
    # The route says 50 %, but the data plane still serves the route as the user wrote it: the canary gets nothing.
    gateway.configure(user_route(), {"llama": [real_vllm.bf16.url]})
    canary, baseline = await measure(gateway, prometheus, REQUESTS)
    print(f"route at 50%, data plane as written: canary served {canary:.1f}, baseline {baseline:.1f} requests")
    assert canary == 0 and baseline >= REQUESTS
    status, reason, _ = judge(50.0, canary, baseline)
    assert (status, reason) == (ConditionStatus.FALSE, Reason.NO_CANARY_TRAFFIC)
