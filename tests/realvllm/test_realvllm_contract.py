"""Simulator fidelity: `kvpolicy sim` and real vLLM 0.32 (CPU build) are asked the same things, and whatever the
operator, the gates or the analysis read must look the same on both: response fields and their JSON types, error
shapes and messages, and the metric series (names, types, label names, histogram bounds) the project reads, plus
every series the simulator exports (it must not invent any).

Differences this test found, all fixed in the simulator: no vllm:cache_config_info; no http_requests_total; no
`repetition` finished_reason; prompt + max_tokens past max_model_len refused instead of max_tokens shortened; other
error messages (prompt too long, max_tokens past max_model_len, unknown model); missing response fields
(/v1/models `permission`, /tokenize `token_strs`, completion `service_tier`, `system_fingerprint`, `kv_transfer_params`,
`ec_transfer_params`, `metrics`, per-choice `token_ids`, `prompt_logprobs`, `prompt_token_ids`, `routed_experts`,
usage `*_details`, streamed chunks' `prompt_token_ids` and `token_ids`, the usage chunk's `system_fingerprint`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from kvpolicy.analysis import metric_names
from kvpolicy_dev.sim import SimConfig, serve
from prometheus_client.parser import text_string_to_metric_families
from realvllm_helpers import MAX_MODEL_LEN, SERVED_MODEL, SKIP_LAYERS, RealPair

# The simulators run on the session loop, as the async fixtures do.
pytestmark = [pytest.mark.realvllm, pytest.mark.asyncio(loop_scope="session")]

# Token 5 decodes to one character in both tokenizers, so a list of them is a prompt of exactly that many tokens.
TOKEN = 5


def shape(value: Any) -> Any:
    """The JSON structure without values: keys and value types (lists by their first item)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any


async def call(session: aiohttp.ClientSession, base: str, path: str, body: Mapping[str, Any] | None = None) -> Reply:
    method = "GET" if body is None else "POST"
    async with session.request(method, base + path, json=body) as response:
        text = await response.text()
        return Reply(response.status, json.loads(text) if text else None)


async def stream(session: aiohttp.ClientSession, base: str, body: Mapping[str, Any]) -> list[Any]:
    """The SSE payloads of a streamed completion, `[DONE]` as the string."""
    payloads: list[Any] = []
    async with session.post(base + "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data:"):
                data = line[len(b"data:") :].strip().decode()
                payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


@pytest.fixture
async def servers(real_vllm: RealPair) -> AsyncIterator[dict[str, tuple[str, str]]]:
    """(real URL, simulator URL) per KV dtype; each simulator is configured like its real counterpart."""
    common = {"served_model_name": SERVED_MODEL, "max_model_len": MAX_MODEL_LEN, "time_scale": 0.0}
    fp8 = SimConfig(**common, kv_cache_dtype="fp8", skip_layers=SKIP_LAYERS, attention_backend="FLASH_ATTN")
    async with serve(SimConfig(**common)) as bf16_sim, serve(fp8) as fp8_sim:
        yield {"bf16": (real_vllm.bf16.url, bf16_sim), "fp8": (real_vllm.fp8.url, fp8_sim)}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        yield client


async def test_models_tokenize_and_health_answer_alike(
    servers: dict[str, tuple[str, str]], session: aiohttp.ClientSession
) -> None:
    real, sim = servers["bf16"]
    for path, body in (("/v1/models", None), ("/tokenize", {"model": SERVED_MODEL, "prompt": "The sky is blue."})):
        answers = [await call(session, base, path, body) for base in (real, sim)]
        assert [a.status for a in answers] == [200, 200], path
        assert shape(answers[0].body) == shape(answers[1].body), path
    models = [(await call(session, base, "/v1/models")).body["data"][0] for base in (real, sim)]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(SERVED_MODEL, MAX_MODEL_LEN)] * 2
    for base in (real, sim):
        async with session.get(base + "/health") as response:
            assert (response.status, await response.read()) == (200, b"")


async def test_completions_have_the_same_fields_streamed_or_not(
    servers: dict[str, tuple[str, str]], session: aiohttp.ClientSession
) -> None:
    real, sim = servers["fp8"]
    # Greedy, so the random-weight model's answer is the same every run.
    request = {"model": SERVED_MODEL, "prompt": [TOKEN] * 40, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    whole = [await call(session, base, "/v1/completions", request) for base in (real, sim)]
    assert [w.status for w in whole] == [200, 200]
    assert shape(whole[0].body) == shape(whole[1].body)
    for reply in whole:
        assert reply.body["usage"]["prompt_tokens"] == 40 and reply.body["usage"]["completion_tokens"] == 6
        assert reply.body["choices"][0]["finish_reason"] == "length"
    for options in ({"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}):
        streamed = [await stream(session, base, {**request, "stream_options": options}) for base in (real, sim)]
        for payloads, reply in zip(streamed, whole, strict=True):
            # Chunks with text (up to one per token: vLLM sends the tokens made before the client read the last chunk
            # together), a usage chunk, DONE. The latency gate times the chunks by their continuous usage.
            chunks, usage, done = payloads[:-2], payloads[-2], payloads[-1]
            assert 1 <= len(chunks) <= 6 and done == "[DONE]", payloads
            # Greedy: the same text as the whole completion from that server.
            assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == reply.body["choices"][0]["text"]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
            counts = [chunk["usage"]["completion_tokens"] for chunk in chunks if "usage" in chunk]
            if options.get("continuous_usage_stats"):
                assert len(counts) == len(chunks) and counts == sorted(set(counts)) and counts[-1] == 6, counts
            else:
                assert counts == []
        real_chunks, sim_chunks = streamed
        assert shape(real_chunks[0]) == shape(sim_chunks[0]) and shape(real_chunks[-2]) == shape(sim_chunks[-2])


@pytest.mark.parametrize(
    "case",
    [
        "prompt past max_model_len",
        "prompt of exactly max_model_len",
        "max_tokens past max_model_len",
        "max_tokens 0",
        "unknown model",
        "prompt + max_tokens past max_model_len is shortened",
    ],
)
async def test_errors_and_length_limits_match(
    case: str, servers: dict[str, tuple[str, str]], session: aiohttp.ClientSession
) -> None:
    bodies = {
        "prompt past max_model_len": {"prompt": "blue " * (MAX_MODEL_LEN + 10), "max_tokens": 4},
        "prompt of exactly max_model_len": {"prompt": [TOKEN] * MAX_MODEL_LEN, "max_tokens": 4},
        "max_tokens past max_model_len": {"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1},
        "max_tokens 0": {"prompt": "hi", "max_tokens": 0},
        "unknown model": {"model": "nobody", "prompt": "hi"},
        "prompt + max_tokens past max_model_len is shortened": {
            "prompt": [TOKEN] * (MAX_MODEL_LEN - 3),
            "max_tokens": 50,
            "ignore_eos": True,
        },
    }
    real, sim = servers["bf16"]
    request = {"model": SERVED_MODEL, **bodies[case]}
    real_reply, sim_reply = [await call(session, base, "/v1/completions", request) for base in (real, sim)]
    assert real_reply.status == sim_reply.status
    if real_reply.status == 200:
        assert real_reply.body["usage"] == sim_reply.body["usage"]
        assert real_reply.body["usage"]["completion_tokens"] == 3
    else:
        assert real_reply.body == sim_reply.body, "same status, type, param, code and message"


def series(text: str) -> dict[str, dict[str, Any]]:
    """Each metric family: its type, and per sample name the label names (histogram bounds kept apart)."""
    found: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        entry = found.setdefault(family.name, {"type": family.type, "samples": {}, "bounds": set()})
        for sample in family.samples:
            labels = frozenset(sample.labels) - {"le"}
            entry["samples"].setdefault(sample.name, set()).add(labels)
            if "le" in sample.labels:
                entry["bounds"].add(float(sample.labels["le"]))
    return found


def family_of(sample: str, families: Mapping[str, Any]) -> str:
    for family, entry in families.items():
        if sample in entry["samples"]:
            return family
    raise AssertionError(f"no family exports {sample}")


# What the project reads from vLLM: the analysis (both providers) and the demo, and the served KV cache
# configuration, by which a canary's real KV dtype and skip layers can be checked.
READ_BY_THE_PROJECT = (
    f"vllm:{metric_names.TTFT}_bucket",
    f"vllm:{metric_names.TTFT}_count",
    f"vllm:{metric_names.TTFT}_sum",
    f"vllm:{metric_names.ITL}_bucket",
    f"vllm:{metric_names.ITL}_sum",
    f"vllm:{metric_names.REQUEST_SUCCESS}",
    f"vllm:{metric_names.KV_CACHE_USAGE[0]}",
    metric_names.HTTP_REQUESTS,
    "vllm:cache_config_info",
)


async def test_metrics_match_in_names_types_labels_and_buckets(
    servers: dict[str, tuple[str, str]], session: aiohttp.ClientSession
) -> None:
    for dtype, (real, sim) in servers.items():
        for base in (real, sim):  # the same traffic: a completion, a streamed one, a refused one, a tokenize
            request = {"model": SERVED_MODEL, "prompt": [TOKEN] * 30, "max_tokens": 4}
            await call(session, base, "/v1/completions", request)
            await stream(session, base, request)
            await call(session, base, "/v1/completions", {**request, "max_tokens": MAX_MODEL_LEN + 1})
            await call(session, base, "/tokenize", {"model": SERVED_MODEL, "prompt": "hi"})
        scraped = []
        for base in (real, sim):
            async with session.get(base + "/metrics") as response:
                assert response.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
                scraped.append(series(await response.text()))
        real_series, sim_series = scraped
        sim_samples = {name for entry in sim_series.values() for name in entry["samples"]}
        assert set(READ_BY_THE_PROJECT) <= sim_samples, dtype
        for name in sorted(sim_samples):  # every series the simulator exports, the read ones among them
            real_family, sim_family = family_of(name, real_series), family_of(name, sim_series)
            real_entry, sim_entry = real_series[real_family], sim_series[sim_family]
            assert real_entry["samples"][name] == sim_entry["samples"][name], f"{dtype}: label names of {name}"
            if real_family == sim_family:  # vLLM exports `_created` as gauge families of their own
                assert real_entry["type"] == sim_entry["type"], f"{dtype}: type of {real_family}"
                assert real_entry["bounds"] == sim_entry["bounds"], f"{dtype}: histogram bounds of {real_family}"


async def test_cache_config_info_says_which_kv_cache_is_served(
    servers: dict[str, tuple[str, str]], session: aiohttp.ClientSession
) -> None:
    expected = {"bf16": ("auto", "[]"), "fp8": ("fp8", str(list(SKIP_LAYERS)))}
    for dtype, bases in servers.items():
        for base in bases:
            async with session.get(base + "/metrics") as response:
                families = {f.name: f for f in text_string_to_metric_families(await response.text())}
            (sample,) = families["vllm:cache_config_info"].samples
            labels = sample.labels
            assert (labels["cache_dtype"], labels["kv_cache_dtype_skip_layers"]) == expected[dtype], base
            assert sample.value == 1.0


async def test_a_model_without_a_chat_template_refuses_messages_alike(
    real_vllm: RealPair, session: aiohttp.ClientSession
) -> None:
    """The tiny model has no chat template: vLLM 0.32 refuses a chat on /tokenize and /v1/chat/completions with 400
    (the accuracy gate's promptFormat Auto reads that as "no chat template"); the simulator started with
    --no-chat-template answers alike."""
    config = SimConfig(served_model_name=SERVED_MODEL, max_model_len=MAX_MODEL_LEN, time_scale=0.0, chat_template=False)
    messages = [{"role": "user", "content": "The sky is blue."}]
    requests = (
        ("/tokenize", {"model": SERVED_MODEL, "messages": messages, "add_generation_prompt": True}),
        ("/v1/chat/completions", {"model": SERVED_MODEL, "messages": messages, "max_tokens": 4}),
    )
    async with serve(config) as sim:
        for path, body in requests:
            real_reply, sim_reply = [await call(session, base, path, body) for base in (real_vllm.bf16.url, sim)]
            assert (real_reply.status, sim_reply.status) == (400, 400), (path, real_reply.body)
            assert real_reply.body == sim_reply.body, path
