"""Metrics provider that scrapes the pods' /metrics directly, for clusters without Prometheus.

Counters and histograms are cumulative, so a window's latency is the difference between the scrape made now and one
made a window ago. The provider keeps recent scrapes per pod; the first check of a pod has nothing to subtract and
reports no requests (NoData), which the analysis treats as inconclusive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpolicy.analysis import metric_names
from kvpolicy.analysis.histogram import CumulativeHistogram
from kvpolicy.analysis.http import HttpClient
from kvpolicy.analysis.model import ProviderUnavailableError, SideMetrics, SideSelector
from kvpolicy.analysis.provider import PromQL, ServedConfig, ServedReading
from kvpolicy.analysis.served import CACHE_CONFIG, reading, served_config
from kvpolicy.api.reasons import AnalysisReason
from kvpolicy.credentials import Credentials
from kvpolicy.http_errors import auth_hint, connection_problem, redact_url, status_text

log = logging.getLogger(__name__)

_HISTOGRAMS = (metric_names.TTFT, metric_names.ITL, metric_names.ITL_DEPRECATED)


@dataclass(frozen=True)
class PodScrape:
    """The cumulative values of one /metrics scrape that the analysis needs, summed over label sets."""

    at: float
    histograms: Mapping[str, CumulativeHistogram]
    finished: Mapping[str, float]  # finished_reason -> requests
    http_statuses: Mapping[str, float]  # status -> requests
    kv_cache_usage: float | None
    has_vllm_series: bool
    served: ServedConfig | None = None  # from vllm:cache_config_info


def parse_scrape(text: str, at: float) -> PodScrape:
    """Extract the vLLM series from a Prometheus text exposition (either spelling of the `vllm` prefix)."""
    buckets: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    finished: dict[str, float] = {}
    http_statuses: dict[str, float] = {}
    kv_values: list[float] = []
    has_vllm_series = False
    served: ServedConfig | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric_names.HTTP_REQUESTS:
                status = sample.labels.get("status", "")
                http_statuses[status] = http_statuses.get(status, 0.0) + sample.value
                continue
            name = metric_names.strip_vllm_prefix(sample.name)
            if name is None:
                continue
            has_vllm_series = True
            if name == metric_names.REQUEST_SUCCESS:
                reason = sample.labels.get("finished_reason", "")
                finished[reason] = finished.get(reason, 0.0) + sample.value
            elif name in metric_names.KV_CACHE_USAGE:
                kv_values.append(sample.value)
            elif name == CACHE_CONFIG:
                served = served_config(sample.labels)
            for histogram in _HISTOGRAMS:
                if name == f"{histogram}_bucket":
                    bound = float(sample.labels["le"])
                    per_bound = buckets.setdefault(histogram, {})
                    per_bound[bound] = per_bound.get(bound, 0.0) + sample.value
                elif name == f"{histogram}_count":
                    counts[histogram] = counts.get(histogram, 0.0) + sample.value
                elif name == f"{histogram}_sum":
                    sums[histogram] = sums.get(histogram, 0.0) + sample.value
    histograms = {
        histogram: CumulativeHistogram(
            bounds, counts.get(histogram, max(bounds.values(), default=0.0)), sums.get(histogram)
        )
        for histogram, bounds in buckets.items()
    }
    kv_cache_usage = sum(kv_values) / len(kv_values) if kv_values else None
    return PodScrape(at, histograms, finished, http_statuses, kv_cache_usage, has_vllm_series, served)


def _counter_delta(now: Mapping[str, float], earlier: Mapping[str, float]) -> dict[str, float]:
    delta: dict[str, float] = {}
    for key, value in now.items():
        before = earlier.get(key, 0.0)
        # A counter that went down was reset (the pod restarted): everything it holds is new.
        delta[key] = value - before if value >= before else value
    return delta


@dataclass(frozen=True)
class _Delta:
    histograms: dict[str, CumulativeHistogram] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    http_statuses: dict[str, float] = field(default_factory=dict)

    def plus(self, now: PodScrape, earlier: PodScrape) -> _Delta:
        histograms = dict(self.histograms)
        for name, histogram in now.histograms.items():
            change = histogram.minus(earlier.histograms.get(name, CumulativeHistogram({}, 0.0, 0.0)))
            histograms[name] = histograms[name].plus(change) if name in histograms else change
        finished = dict(self.finished)
        for key, value in _counter_delta(now.finished, earlier.finished).items():
            finished[key] = finished.get(key, 0.0) + value
        statuses = dict(self.http_statuses)
        for key, value in _counter_delta(now.http_statuses, earlier.http_statuses).items():
            statuses[key] = statuses.get(key, 0.0) + value
        return _Delta(histograms, finished, statuses)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _quantiles(histogram: CumulativeHistogram | None, quantiles: Iterable[float]) -> dict[float, float | None]:
    return {q: histogram.quantile(q) if histogram else None for q in quantiles}


class ScrapeProvider(HttpClient):
    """Scrapes `<endpoint>/metrics` of each pod of a side and compares with the scrape made a window earlier."""

    def __init__(
        self,
        timeout_seconds: float = 5.0,
        forget_after_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        credentials: Credentials | None = None,
    ) -> None:
        super().__init__(timeout_seconds, "scrape", credentials)
        self.forget_after_seconds = forget_after_seconds
        self._clock = clock
        self._history: dict[str, deque[PodScrape]] = {}

    async def _scrape(self, endpoint: str) -> PodScrape:
        """One pod's scrape. Messages hold a status code and a fixed reason, never what the pod sent."""
        url = f"{endpoint.rstrip('/')}/metrics"
        shown = redact_url(url)
        try:
            async with self._client().get(url, headers=self._headers()) as response:
                text = await response.text()
                if response.status != 200:
                    hint = auth_hint(response.status, self.credentials)
                    message = f"{shown} answered {status_text(response.status)}{hint}"
                    raise ProviderUnavailableError(AnalysisReason.SCRAPE_FAILED, message)
        except TimeoutError:
            raise ProviderUnavailableError(
                AnalysisReason.SCRAPE_FAILED, f"{shown} did not answer within {self.timeout_seconds} s"
            ) from None
        except aiohttp.ClientError as exc:
            raise ProviderUnavailableError(
                AnalysisReason.SCRAPE_FAILED, f"cannot scrape {shown}: {connection_problem(exc)}"
            ) from None
        try:
            return parse_scrape(text, self._clock())
        except (ValueError, KeyError) as exc:
            said = str(exc)[:300]
            said = self.credentials.redact(said) if self.credentials is not None else said
            log.warning("%s is not a Prometheus text exposition: %s", shown, said)
            raise ProviderUnavailableError(
                AnalysisReason.SCRAPE_UNPARSEABLE, f"{shown} is not a Prometheus text exposition"
            ) from None

    def _remember(self, endpoint: str, scrape: PodScrape, window_seconds: float) -> PodScrape | None:
        """Store a scrape; return the one to subtract: the newest made at least a window ago, else the oldest."""
        history = self._history.setdefault(endpoint, deque())
        history.append(scrape)
        # Older scrapes are useless once the next one is itself a window old.
        while len(history) > 1 and history[1].at <= scrape.at - window_seconds:
            history.popleft()
        forget_before = scrape.at - self.forget_after_seconds
        for stale in [key for key, kept in self._history.items() if kept[-1].at < forget_before]:
            del self._history[stale]
        earlier = [kept for kept in history if kept.at <= scrape.at - window_seconds]
        if earlier:
            return earlier[-1]
        return history[0] if len(history) > 1 else None

    def promql(self) -> PromQL | None:
        return None  # the pods' /metrics answer no queries

    async def served(self, side: SideSelector) -> ServedReading:
        scrapes = await asyncio.gather(*(self._scrape(endpoint) for endpoint in side.endpoints))
        return reading([scrape.served for scrape in scrapes], "their /metrics")

    async def latency_snapshot(
        self, side: SideSelector, window_seconds: float, quantiles: Sequence[float]
    ) -> SideMetrics:
        scrapes = await asyncio.gather(*(self._scrape(endpoint) for endpoint in side.endpoints))
        delta = _Delta()
        covered: list[float] = []
        series_found = False
        kv_values = [scrape.kv_cache_usage for scrape in scrapes if scrape.kv_cache_usage is not None]
        for endpoint, scrape in zip(side.endpoints, scrapes, strict=True):
            series_found = series_found or scrape.has_vllm_series
            earlier = self._remember(endpoint, scrape, window_seconds)
            if earlier is None:
                continue
            covered.append(scrape.at - earlier.at)
            delta = delta.plus(scrape, earlier)
        ttft = delta.histograms.get(metric_names.TTFT)
        itl_metric = next(
            (name for name in (metric_names.ITL, metric_names.ITL_DEPRECATED) if name in delta.histograms), None
        )
        itl = delta.histograms.get(itl_metric) if itl_metric else None
        finished = sum(delta.finished.values())
        errors = sum(delta.finished.get(reason, 0.0) for reason in metric_names.ERROR_FINISHED_REASONS)
        http_total = sum(delta.http_statuses.values())
        http_errors = sum(value for status, value in delta.http_statuses.items() if status.startswith("5"))
        return SideMetrics(
            role=side.role,
            series_found=series_found,
            requests=ttft.count if ttft else 0.0,
            window_seconds=min(covered, default=0.0),
            ttft_seconds=_quantiles(ttft, quantiles),
            itl_seconds=_quantiles(itl, quantiles),
            itl_metric=itl_metric,
            error_ratio=_ratio(errors, finished),
            http_error_ratio=_ratio(http_errors, http_total),
            kv_cache_usage=sum(kv_values) / len(kv_values) if kv_values else None,
            ttft_mean_seconds=ttft.mean() if ttft else None,
            itl_mean_seconds=itl.mean() if itl else None,
            ttft_bucket_bounds=ttft.bounds if ttft else (),
            itl_bucket_bounds=itl.bounds if itl else (),
            finished_requests=finished if covered else None,
        )
