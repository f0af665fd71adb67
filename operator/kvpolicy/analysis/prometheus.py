"""Metrics provider backed by the Prometheus HTTP API (instant PromQL queries)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from string import Template
from typing import Any

import aiohttp

from kvpolicy.analysis import metric_names
from kvpolicy.analysis.http import HttpClient
from kvpolicy.analysis.model import ProviderUnavailableError, SideMetrics, SideSelector
from kvpolicy.analysis.provider import PromQL, QueryRejectedError, ServedReading
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.analysis.served import CACHE_CONFIG, served_config
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.credentials import Credentials
from kvpolicy.http_errors import auth_hint, connection_problem, redact_url, status_text

log = logging.getLogger(__name__)

# Matches any relabeling that keeps the `namespace` and `pod` target labels (the kubernetes_sd defaults in most setups).
DEFAULT_SELECTOR_TEMPLATE = 'namespace="$namespace", pod=~"$pod_regex"'
TEMPLATE_FIELDS = frozenset({"namespace", "pod_regex", "labels", "role"})


def _string_literal(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _label_name(key: str) -> str:
    """A pod label as Prometheus' labelmap of `__meta_kubernetes_pod_label_(.+)` names it (`app.kubernetes.io/x`
    becomes `app_kubernetes_io_x`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def render_selector(template: str, side: SideSelector) -> str:
    """The label matchers (without braces) selecting one side's series."""
    pod_regex = "|".join(re.escape(pod) for pod in side.pods)
    labels = ", ".join(f'{_label_name(key)}="{_string_literal(value)}"' for key, value in sorted(side.labels.items()))
    return Template(template).substitute(
        namespace=_string_literal(side.namespace),
        pod_regex=_string_literal(pod_regex),
        labels=labels,
        role=_string_literal(side.role),
    )


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _vllm(name: str, matchers: str, extra: str = "") -> str:
    """A selector for a vLLM series under either spelling of its prefix."""
    return f'{{__name__=~"vllm[:_]{name}", {matchers}{extra}}}'


def quantile_query(metric: str, quantile: float, matchers: str, window_seconds: float) -> str:
    bucket = _vllm(f"{metric}_bucket", matchers)
    return f"histogram_quantile({quantile!r}, sum by (le) (rate({bucket}[{_duration(window_seconds)}])))"


def mean_query(metric: str, matchers: str, window_seconds: float) -> str:
    window = _duration(window_seconds)
    total, count = _vllm(f"{metric}_sum", matchers), _vllm(f"{metric}_count", matchers)
    return f"sum(rate({total}[{window}])) / sum(rate({count}[{window}]))"


def bucket_bounds_query(metric: str, matchers: str) -> str:
    """One series per bucket upper bound (`le`) of the side's histogram."""
    return f"count by (le) ({_vllm(f'{metric}_bucket', matchers)})"


def series_query(matchers: str) -> str:
    """Counts the side's vLLM series: any of them shows Prometheus scrapes the pods, with or without traffic (some
    servers create their latency histograms only on the first request)."""
    return f"count({_vllm('.+', matchers)})"


def requests_query(matchers: str, window_seconds: float) -> str:
    return f"sum(increase({_vllm(f'{metric_names.TTFT}_count', matchers)}[{_duration(window_seconds)}]))"


def finished_query(matchers: str, window_seconds: float) -> str:
    """Requests the side finished in the window, every finished_reason (its share of the traffic)."""
    return f"sum(increase({_vllm(metric_names.REQUEST_SUCCESS, matchers)}[{_duration(window_seconds)}]))"


def error_ratio_query(matchers: str, window_seconds: float) -> str:
    window = _duration(window_seconds)
    reasons = "|".join(metric_names.ERROR_FINISHED_REASONS)
    errors = _vllm(metric_names.REQUEST_SUCCESS, matchers, f', finished_reason=~"{reasons}"')
    finished = _vllm(metric_names.REQUEST_SUCCESS, matchers)
    # `or vector(0)`: a server that never failed may not export the error series at all.
    return f"(sum(increase({errors}[{window}])) or vector(0)) / sum(increase({finished}[{window}]))"


def http_error_ratio_query(matchers: str, window_seconds: float) -> str:
    window = _duration(window_seconds)
    errors = f'{metric_names.HTTP_REQUESTS}{{{matchers}, status=~"5.."}}'
    total = f"{metric_names.HTTP_REQUESTS}{{{matchers}}}"
    return f"(sum(increase({errors}[{window}])) or vector(0)) / sum(increase({total}[{window}]))"


def kv_cache_usage_query(matchers: str, window_seconds: float) -> str:
    gauge = _vllm(f"({'|'.join(metric_names.KV_CACHE_USAGE)})", matchers)
    return f"avg(avg_over_time({gauge}[{_duration(window_seconds)}]))"


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class _HistogramReading:
    quantiles: dict[float, float | None]
    mean: float | None
    bounds: tuple[float, ...]

    @property
    def empty(self) -> bool:
        return self.mean is None and all(value is None for value in self.quantiles.values())


# Prometheus' own error types (api/v1 `errorType`): a fixed vocabulary, safe to repeat; its `error` text is not.
PROMETHEUS_ERROR_TYPES = frozenset(
    {"timeout", "canceled", "execution", "bad_data", "internal", "unavailable", "not_found", "not_acceptable"}
)


class PrometheusProvider(HttpClient):
    """Reads both sides' latency over the window from Prometheus. Errors raise ProviderUnavailableError.

    Messages carry a status code and a fixed reason, never the response body: they reach status and events, and
    prometheusURL may point anywhere the operator can reach. The body of a rejected query is logged instead.
    """

    def __init__(
        self,
        base_url: str,
        timeout_seconds: float = 10.0,
        selector_template: str = DEFAULT_SELECTOR_TEMPLATE,
        credentials: Credentials | None = None,
    ) -> None:
        if not re.match(r"^https?://[^/]+", base_url):
            raise ValueError(
                f"Prometheus URL {redact_url(base_url)!r} must start with http:// or https:// and name a host"
            )
        template = Template(selector_template)
        unknown = set(template.get_identifiers()) - TEMPLATE_FIELDS
        if unknown or not template.is_valid():
            raise ValueError(
                f"selector template {selector_template!r}: use only ${', $'.join(sorted(TEMPLATE_FIELDS))} "
                f"(unknown: {sorted(unknown)})"
            )
        super().__init__(timeout_seconds, "Prometheus", credentials)
        self.base_url = base_url.rstrip("/")
        self.shown_url = redact_url(self.base_url)
        self.selector_template = selector_template
        # For the served configuration of pods Prometheus does not scrape (served()); no credentials: they are
        # Prometheus', and vLLM's /metrics wants none.
        self._direct = ScrapeProvider(timeout_seconds=min(timeout_seconds, 5.0))

    async def query(self, promql: str) -> list[float]:
        """Evaluate an instant query; one value per series of the resulting vector (NaN stays NaN)."""
        return [value for _, value in await self.query_samples(promql)]

    async def query_samples(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """Evaluate an instant query; the labels and value of each series of the resulting vector."""
        url = f"{self.base_url}/api/v1/query"
        form = {"query": promql, "timeout": _duration(self.timeout_seconds)}
        try:
            async with self._client().post(url, data=form, headers=self._headers()) as response:
                body = await response.text()
                status = response.status
        except TimeoutError:
            raise ProviderUnavailableError(
                AnalysisReason.PROMETHEUS_TIMEOUT,
                f"Prometheus at {self.shown_url} did not answer within {self.timeout_seconds} s",
            ) from None
        except aiohttp.ClientError as exc:
            tls = isinstance(exc, aiohttp.ClientSSLError)
            raise ProviderUnavailableError(
                AnalysisReason.PROMETHEUS_TLS_ERROR if tls else AnalysisReason.PROMETHEUS_UNREACHABLE,
                f"cannot reach Prometheus at {self.shown_url}: {connection_problem(exc)}",
            ) from None
        if status in (401, 403):
            raise ProviderUnavailableError(
                AnalysisReason.PROMETHEUS_UNAUTHORIZED,
                f"Prometheus at {self.shown_url} answered {status_text(status)}{auth_hint(status, self.credentials)}",
            )
        if status >= 500:
            raise ProviderUnavailableError(
                AnalysisReason.PROMETHEUS_SERVER_ERROR, f"Prometheus at {self.shown_url} answered {status_text(status)}"
            )
        try:
            payload: dict[str, Any] = json.loads(body)
        except json.JSONDecodeError:
            payload = {}
        if status >= 400 or payload.get("status") != "success":
            error_type = payload.get("errorType")
            known = f", {error_type}" if error_type in PROMETHEUS_ERROR_TYPES else ""
            said = str(payload.get("error"))[:300]
            said = self.credentials.redact(said) if self.credentials is not None else said
            log.warning("Prometheus at %s rejected %r: %s", self.shown_url, promql, said)
            raise QueryRejectedError(
                AnalysisReason.QUERY_REJECTED,
                f"Prometheus at {self.shown_url} rejected {promql!r} ({status_text(status)}{known})",
            )
        data = payload.get("data", {})
        if data.get("resultType") != "vector":
            raise QueryRejectedError(
                AnalysisReason.QUERY_REJECTED,
                f"Prometheus at {self.shown_url} answered {promql!r} with something else than a vector",
            )
        return [(sample.get("metric", {}), float(sample["value"][1])) for sample in data.get("result", [])]

    def promql(self) -> PromQL:
        return self

    def matchers(self, side: SideSelector) -> str:
        """The label matchers (without braces) that select one side's series, from the selector template."""
        return render_selector(self.selector_template, side)

    async def served(self, side: SideSelector) -> ServedReading:
        matchers = self.matchers(side)
        samples = await self.query_samples(_vllm(CACHE_CONFIG, matchers))
        if samples:
            return ServedReading(configs=tuple(served_config(labels) for labels, _ in samples))
        missing = f"Prometheus at {self.shown_url} has no vllm:{CACHE_CONFIG} of the {side.role}"
        if not side.endpoints:
            return ServedReading(missing=missing)
        # Before its accuracy gate the canary carries only kvpolicy's labels, so unless a monitor selects them (the
        # chart's PodMonitor) nothing scrapes it yet: read what it serves from its pods' own /metrics (open on vLLM,
        # as the Scrape provider reads it) rather than wait out the progress deadline and roll back.
        try:
            direct = await self._direct.served(side)
        except ProviderUnavailableError as error:
            return ServedReading(missing=f"{missing}, and its pods' /metrics could not be read: {error.message}")
        if direct.missing is not None:
            return ServedReading(missing=f"{missing}; {direct.missing}")
        log.info("%s; read the %s's vllm:%s from its pods' /metrics", missing, side.role, CACHE_CONFIG)
        return direct

    async def close(self) -> None:
        await super().close()
        await self._direct.close()

    async def _single(self, promql: str) -> float | None:
        """The value of a query that aggregates to one series; None for an empty vector."""
        values = await self.query(promql)
        return values[0] if values else None

    async def _bucket_bounds(self, metric: str, matchers: str) -> tuple[float, ...]:
        samples = await self.query_samples(bucket_bounds_query(metric, matchers))
        return tuple(sorted({float(labels["le"]) for labels, _ in samples if "le" in labels}))

    async def _histogram(
        self, metric: str, quantiles: Sequence[float], matchers: str, window_seconds: float
    ) -> _HistogramReading:
        queries = [quantile_query(metric, q, matchers, window_seconds) for q in quantiles]
        values, mean, bounds = await asyncio.gather(
            asyncio.gather(*(self._single(query) for query in queries)),
            self._single(mean_query(metric, matchers, window_seconds)),
            self._bucket_bounds(metric, matchers),
        )
        return _HistogramReading(
            {q: _finite(value) for q, value in zip(quantiles, values, strict=True)}, _finite(mean), bounds
        )

    async def latency_snapshot(
        self, side: SideSelector, window_seconds: float, quantiles: Sequence[float]
    ) -> SideMetrics:
        if not side.pods:
            empty = dict.fromkeys(quantiles)
            return SideMetrics(side.role, False, 0.0, window_seconds, empty, empty)
        matchers = self.matchers(side)
        scalars = (
            series_query(matchers),
            requests_query(matchers, window_seconds),
            error_ratio_query(matchers, window_seconds),
            http_error_ratio_query(matchers, window_seconds),
            kv_cache_usage_query(matchers, window_seconds),
            finished_query(matchers, window_seconds),
        )
        values, ttft, itl = await asyncio.gather(
            asyncio.gather(*(self._single(query) for query in scalars)),
            self._histogram(metric_names.TTFT, quantiles, matchers, window_seconds),
            self._histogram(metric_names.ITL, quantiles, matchers, window_seconds),
        )
        series, requests, error_ratio, http_error_ratio, kv_cache_usage, finished = values
        itl_metric: str | None = metric_names.ITL
        if itl.empty:  # no ITL series at all: an older vLLM
            itl = await self._histogram(metric_names.ITL_DEPRECATED, quantiles, matchers, window_seconds)
            itl_metric = None if itl.empty else metric_names.ITL_DEPRECATED
        return SideMetrics(
            role=side.role,
            series_found=series is not None,
            requests=_finite(requests) or 0.0,
            window_seconds=window_seconds,
            ttft_seconds=ttft.quantiles,
            itl_seconds=itl.quantiles,
            itl_metric=itl_metric,
            error_ratio=_finite(error_ratio),
            http_error_ratio=_finite(http_error_ratio),
            kv_cache_usage=_finite(kv_cache_usage),
            ttft_mean_seconds=ttft.mean,
            itl_mean_seconds=itl.mean,
            ttft_bucket_bounds=ttft.bounds,
            itl_bucket_bounds=itl.bounds,
            finished_requests=_finite(finished),
        )
