"""Parsing a /metrics exposition into the values the scrape provider needs."""

from __future__ import annotations

import pytest
from fake_vllm import VLLMMetrics
from kvpolicy.analysis.scrape import parse_scrape


def test_both_prefix_spellings_parse_the_same() -> None:
    colon, underscore = VLLMMetrics("vllm:"), VLLMMetrics("vllm_")
    for metrics in (colon, underscore):
        for _ in range(3):
            metrics.record(0.2, 0.05)
    parsed_colon = parse_scrape(colon.exposition().decode(), 0.0)
    assert parsed_colon == parse_scrape(underscore.exposition().decode(), 0.0)
    assert parsed_colon.histograms["time_to_first_token_seconds"].count == 3
    assert parsed_colon.histograms["inter_token_latency_seconds"].count == 9
    assert parsed_colon.histograms["inter_token_latency_seconds"].total == pytest.approx(9 * 0.05)


def test_sums_label_sets_and_skips_other_metrics() -> None:
    text = """# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="a"} 1
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="a"} 2
vllm:time_to_first_token_seconds_count{engine="0",model_name="a"} 2
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="a"} 3
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="a"} 3
vllm:time_to_first_token_seconds_count{engine="1",model_name="a"} 3
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.4
vllm:request_success_total{engine="0",finished_reason="stop",model_name="a"} 5
vllm:num_requests_running{engine="0",model_name="a"} 7
process_cpu_seconds_total 12
"""
    parsed = parse_scrape(text, 3.0)
    ttft = parsed.histograms["time_to_first_token_seconds"]
    assert ttft.count == 5 and dict(ttft.buckets) == {0.1: 4, float("inf"): 5}
    assert ttft.total is None and ttft.mean() is None  # no _sum series: no mean
    assert parsed.kv_cache_usage == pytest.approx(0.3)
    assert parsed.finished == {"stop": 5} and parsed.http_statuses == {} and parsed.at == 3.0


@pytest.mark.parametrize(
    ("text", "has_vllm_series"),
    [
        # An idle server that creates its histograms on the first request still shows it is a vLLM being scraped.
        ('vllm:num_requests_running{engine="0",model_name="m"} 0\n', True),
        ('vllm_num_requests_running{engine="0",model_name="m"} 0\n', True),
        ("process_cpu_seconds_total 12\nvllmish_metric 1\n", False),
    ],
)
def test_knows_a_vllm_without_latency_series(text: str, has_vllm_series: bool) -> None:
    parsed = parse_scrape(text, 0.0)
    assert parsed.has_vllm_series is has_vllm_series and parsed.histograms == {}
