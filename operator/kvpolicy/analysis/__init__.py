"""Latency analysis of a canary against its baseline: metrics providers, pure verdicts, and the analysis state machine.

The operator builds a `LatencyGateConfig` (model.py) from the KVPolicy spec and two `SideSelector`s, evaluates the
metrics checks (checks.py; the TTFT/ITL one is latency_check.py's reading and verdicts.py's `assess`) every
`interval_seconds` through a `MetricsProvider` (provider.py: Prometheus, or the pods' own /metrics), and folds each
combined verdict into the `AnalysisState` it keeps in status with `next_analysis_state`.

The package re-exports nothing, so importing a pure module (model, verdicts, checks) does not load the HTTP providers.
"""
