"""Latency analysis of a canary against its baseline: metrics providers, pure verdicts, and the analysis state machine.

The operator builds a `LatencyGateConfig` from the KVPolicy spec and two `SideSelector`s, evaluates the metrics checks
(checks.py; the TTFT/ITL one is `run_check`'s reading and `assess`) every `interval_seconds`, and folds each combined
verdict into the `AnalysisState` it keeps in status with `next_analysis_state`.
"""

from kvpolicy.analysis.latency_check import MetricsProvider, run_check
from kvpolicy.analysis.model import (
    DEFAULT_QUANTILES,
    Action,
    AnalysisState,
    LatencyGateConfig,
    MeanCheck,
    Outcome,
    ProviderUnavailableError,
    RatioCheck,
    SideMetrics,
    SideSelector,
    Verdict,
    parse_ratio,
    quantile_label,
)
from kvpolicy.analysis.prometheus import DEFAULT_SELECTOR_TEMPLATE, PrometheusProvider
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.analysis.verdicts import assess, next_analysis_state
from kvpolicy.api.v1alpha1 import OnInconclusive, VerdictKind

__all__ = [
    "DEFAULT_QUANTILES",
    "DEFAULT_SELECTOR_TEMPLATE",
    "Action",
    "AnalysisState",
    "LatencyGateConfig",
    "MeanCheck",
    "MetricsProvider",
    "OnInconclusive",
    "Outcome",
    "PrometheusProvider",
    "ProviderUnavailableError",
    "RatioCheck",
    "ScrapeProvider",
    "SideMetrics",
    "SideSelector",
    "Verdict",
    "VerdictKind",
    "assess",
    "next_analysis_state",
    "parse_ratio",
    "quantile_label",
    "run_check",
]
