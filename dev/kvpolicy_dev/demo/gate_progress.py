"""How far a running accuracy gate is, read from the canary's own request counter.

The gate Job reports only when it ends, but during the gate the canary serves nothing else (it joins user traffic only
after passing), so the requests it has finished are the NIAH prompts answered so far.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from kvpolicy.analysis.metric_names import REQUEST_SUCCESS, VLLM_PREFIXES
from kvpolicy.rollout.builders import POLICY_LABEL, ROLE_CANARY, ROLE_LABEL
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_SECONDS = 2.0
_REQUEST_COUNTERS = frozenset(f"{prefix}{REQUEST_SUCCESS}" for prefix in VLLM_PREFIXES)


def finished_requests(exposition: str) -> int:
    """Requests a vLLM server has finished, from its /metrics text (every finish reason counted)."""
    total = 0.0
    for family in text_string_to_metric_families(exposition):
        total += sum(sample.value for sample in family.samples if sample.name in _REQUEST_COUNTERS)
    return int(total)


def canary_endpoints(pods: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Metrics URLs of the ready canary pods, per policy name."""
    result: dict[str, list[str]] = defaultdict(list)
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        ip = (pod.get("status") or {}).get("podIP")
        containers = (pod.get("spec") or {}).get("containers") or []
        ports = (containers[0].get("ports") or []) if containers else []
        if labels.get(ROLE_LABEL) != ROLE_CANARY or POLICY_LABEL not in labels or not ip or not ports:
            continue
        result[labels[POLICY_LABEL]].append(f"http://{ip}:{ports[0]['containerPort']}/metrics")
    return dict(result)


async def _scrape(session: aiohttp.ClientSession, url: str) -> int | None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with session.get(url) as response:
            if response.status == 200:
                return finished_requests(await response.text())
    return None


async def canary_requests(
    session: aiohttp.ClientSession, pods: Sequence[Mapping[str, Any]], policies: Sequence[str]
) -> dict[str, int]:
    """Finished requests of each named policy's canary pods (policies whose canary cannot be read are left out)."""
    endpoints = canary_endpoints(pods)
    wanted = [(policy, url) for policy in policies for url in endpoints.get(policy, [])]
    counts = await asyncio.gather(*(_scrape(session, url) for _, url in wanted))
    result: dict[str, int] = {}
    for (policy, _), count in zip(wanted, counts, strict=True):
        if count is not None:
            result[policy] = result.get(policy, 0) + count
    return result
