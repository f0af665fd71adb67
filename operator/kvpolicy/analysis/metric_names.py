"""vLLM metric names, without their prefix: vLLM exports `vllm:NAME`, and some relabelings or exporters turn the colon
into an underscore, so both providers accept `vllm:` and `vllm_`."""

from __future__ import annotations

VLLM_PREFIXES = ("vllm:", "vllm_")
TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
# Deprecated in vLLM 0.11 in favour of ITL; read only when a server does not export ITL.
ITL_DEPRECATED = "time_per_output_token_seconds"
REQUEST_SUCCESS = "request_success_total"
# `gpu_cache_usage_perc` is the pre-V1 name of the same gauge.
KV_CACHE_USAGE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")
# prometheus-fastapi-instrumentator's counter in vLLM's API server, unprefixed; status is "5xx" or a code such as "503".
HTTP_REQUESTS = "http_requests_total"
# finished_reason values of requests that did not complete normally ("stop" and "length" are normal endings).
ERROR_FINISHED_REASONS = ("abort", "error")


def strip_vllm_prefix(name: str) -> str | None:
    """The unprefixed name of a vLLM metric, or None for a metric that is not vLLM's."""
    for prefix in VLLM_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None
