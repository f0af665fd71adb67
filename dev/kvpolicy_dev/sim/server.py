"""An aiohttp server that behaves like vLLM's OpenAI-compatible server for one simulated configuration."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web
from kvpolicy.gate_programs.niah import FILLER, parse_prompt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvpolicy_dev.sim.accuracy import NumericsModel, answer_conversation, answer_needles, parse_conversation
from kvpolicy_dev.sim.config import Gpu, SimConfig
from kvpolicy_dev.sim.latency import latency_fit, sample_latencies
from kvpolicy_dev.sim.tokenizer import load_tokenizer

# vLLM's default buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip

GPU_MEMORY_GIB = {Gpu.H100: 80, Gpu.H200: 141, Gpu.B200: 180, Gpu.A100: 80, Gpu.L40S: 48}
WEIGHTS_GIB = 16  # an 8B model in BF16
GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_TOKENS = 16
# vLLM's FinishReason values, the `finished_reason` label of vllm:request_success_total.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# What real vLLM 0.32 reports in its responses (the contract test, tests/realvllm, compares the two).
VLLM_VERSION = "0.32.0"
BLOCK_SIZE = 16  # vLLM's default KV block on CUDA
# prometheus-fastapi-instrumentator in vLLM's API server counts requests by handler, method and status class, but not
# /health or /metrics.
UNCOUNTED_HANDLERS = frozenset({"/health", "/metrics"})
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-sim"


def token_count_buckets(max_model_len: int) -> list[float]:
    """vLLM's build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ... up to the limit."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class RequestError(Exception):
    """A request vLLM would reject; rendered in vLLM's error shape."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.param = param

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.status}}
        return web.json_response(body, status=self.status)


class Metrics:
    """vLLM's Prometheus metrics for one server, in their own registry."""

    def __init__(self, config: SimConfig) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.label_values = {"model_name": config.served_model_name, "engine": "0"}
        r = self.registry

        def histogram(name: str, doc: str, buckets: list[float] | tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        token_buckets = token_count_buckets(config.max_model_len)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens_hist = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.generation_tokens_hist = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        )
        cache_config = cache_config_labels(config)
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(cache_config), registry=r
        ).labels(**cache_config).set(1)
        self.http_requests = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            ["handler", "method", "status"],
            registry=r,
        )
        # vLLM registers every series at start-up, so a scrape before the first request already sees zeros and
        # Prometheus catches the first increase.
        histograms = (
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
            self.prefill,
            self.decode,
            self.prompt_tokens_hist,
            self.generation_tokens_hist,
        )
        scalars = (self.prompt_tokens, self.generation_tokens, self.running, self.waiting, self.kv_usage)
        for metric in (*histograms, *scalars):
            metric.labels(**self.label_values)
        for reason in FINISHED_REASONS:
            self.success.labels(**self.label_values, finished_reason=reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def kv_cache_capacity_tokens(config: SimConfig) -> int:
    bytes_per_token = config.num_layers * config.layer_kv_elements * (1 if config.fp8 else 2)
    free_gib = GPU_MEMORY_GIB[config.gpu] * GPU_MEMORY_UTILIZATION - WEIGHTS_GIB
    return max(1, int(free_gib * 2**30 / bytes_per_token))


def cache_config_labels(config: SimConfig) -> dict[str, str]:
    """vllm:cache_config_info's labels as vLLM 0.32 publishes them (str() of each CacheConfig field). cache_dtype and
    kv_cache_dtype_skip_layers say which KV cache the server really runs, whatever its pod spec asked for."""
    tokens = kv_cache_capacity_tokens(config)
    blocks = tokens // BLOCK_SIZE
    values: dict[str, object] = {
        "_block_size_resolved": True,
        "block_size": BLOCK_SIZE,
        "cache_dtype": config.kv_cache_dtype,
        "cache_hit_alignment_tokens": None,
        "effective_attention_block_size": BLOCK_SIZE,
        "enable_mamba_shared_prefix_checkpoint": False,
        "enable_prefix_caching": True,
        "engine": "0",
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "hash_block_size": None,
        "is_attention_free": False,
        "kv_cache_dtype_skip_layers": list(config.skip_layers),
        "kv_cache_layout": None,
        "kv_cache_max_concurrency": blocks * BLOCK_SIZE / config.max_model_len,
        "kv_cache_memory_bytes": None,
        "kv_cache_size_tokens": blocks * BLOCK_SIZE,
        "kv_offloading_backend": "native",
        "kv_offloading_size": None,
        "kv_sharing_fast_prefill": False,
        "mamba_block_size": None,
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": None,
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": None,
        "num_gpu_blocks": blocks,
        "num_gpu_blocks_override": None,
        "prefix_cache_retention_interval": 0,
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": None,
        "replayssm_buffer_len": 16,
        "skip_page_size_padded": None,
        "sliding_window": None,
        "swa_bounded_replay": True,
        "use_kda_recoverssm": False,
        "use_replayssm": False,
        "user_specified_block_size": False,
    }
    return {name: str(value) for name, value in values.items()}


@dataclass(frozen=True)
class CompletionRequest:
    prompt_text: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage in every chunk (with include_usage)
    ignore_eos: bool


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    finish_reason: str


class Simulator:
    """One simulated vLLM server. `app()` gives the aiohttp application."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.metrics = Metrics(config)
        self.numerics = NumericsModel(config)
        self.fit = latency_fit(config)
        self._rng = np.random.default_rng(config.seed)
        self._capacity = kv_cache_capacity_tokens(config)
        self._active_tokens = 0
        self._running = 0
        self._created = int(time.time())
        self.tokenizer = load_tokenizer(config.tokenizer)
        self._filler_tokens = self.tokenizer.encode(" " + FILLER)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self._count_requests, _errors_middleware])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/metrics", self.render_metrics)
        return app

    @web.middleware
    async def _count_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """http_requests_total{handler, method, status="2xx"}, as vLLM's API server counts them."""
        response: web.StreamResponse = await handler(request)
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else None
        if path is not None and path not in UNCOUNTED_HANDLERS:
            status = f"{response.status // 100}xx"
            self.metrics.http_requests.labels(handler=path, method=request.method, status=status).inc()
        return response

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, _: web.Request) -> web.Response:
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                    "object": "model_permission",
                    "created": self._created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def render_metrics(self, _: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.render())
        # What vLLM 0.32 sends for GET /metrics (prometheus-fastapi-instrumentator), whatever the Accept header says.
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    def _chat_text(self, body: dict[str, Any], add_generation_prompt: bool) -> str:
        """The messages through the served model's chat template (ChatML, as SmolLM2-135M-Instruct's), as text."""
        if not self.config.chat_template:
            raise RequestError(400, NO_CHAT_TEMPLATE)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise RequestError(400, "'messages' must be a list of {role, content} strings", param="messages")
        return render_chat(messages, add_generation_prompt)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        self._check_model(body)
        if "messages" in body:
            # vLLM's chat tokenize: the template's text, no special tokens added around it (the template has them).
            add_generation_prompt = body.get("add_generation_prompt", True)
            chat_tokens = self.tokenizer.encode(self._chat_text(body, bool(add_generation_prompt)), False)
            return web.json_response(
                {
                    "count": len(chat_tokens),
                    "max_model_len": self.config.max_model_len,
                    "tokens": chat_tokens,
                    "token_strs": None,
                }
            )
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string", param="prompt")
        add_special_tokens = body.get("add_special_tokens", True)
        if not isinstance(add_special_tokens, bool):
            raise RequestError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        tokens = self.tokenizer.encode(prompt, add_special_tokens)
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens, "token_strs": None}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise RequestError(400, "'tokens' must be a list of integers", param="tokens")
        try:
            return web.json_response({"prompt": self.tokenizer.decode(tokens)})
        except ValueError as error:
            raise RequestError(400, str(error), param="tokens") from error

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        name = self.config.served_model_name
        if model is not None and model != name:
            message = f"The model `{model}` does not exist. Valid aliases: {name}."
            raise RequestError(404, message, "NotFoundError", "model")

    def _parse_completion(self, body: dict[str, Any], chat: bool = False) -> CompletionRequest:
        self._check_model(body)
        prompt = body.get("prompt")
        if chat:
            text = self._chat_text(body, add_generation_prompt=True)
            tokens = self.tokenizer.encode(text, False)
            text, count = self.tokenizer.decode(tokens), len(tokens)
        elif isinstance(prompt, str):
            text, count = prompt, len(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            try:
                text, count = self.tokenizer.decode(prompt), len(prompt)
            except ValueError as error:
                raise RequestError(400, str(error), param="prompt") from error
        else:
            raise RequestError(400, "'prompt' must be a string or a non-empty list of token ids", param="prompt")
        max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise RequestError(400, f"max_tokens must be an integer, got {max_tokens!r}.", param="max_tokens")
        limit = self.config.max_model_len
        if max_tokens > limit:
            raise RequestError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer output "
                f"tokens. (parameter=max_tokens, value={max_tokens})",
                param="max_tokens",
            )
        if count > limit:
            # vLLM tokenizes at most limit + 1 tokens of a text prompt, so it reports "at least" that many.
            seen = limit + 1
            raise RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains at least "
                f"{seen} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                f"length of the input prompt. (parameter=input_tokens, value={seen})",
                param="input_tokens",
            )
        # vLLM 0.32 shortens max_tokens to what the context has room for rather than refusing the request.
        max_tokens = min(max_tokens, limit - count)
        if max_tokens < 1:
            raise RequestError(
                400,
                f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})",
                param="max_tokens",
            )
        options = body.get("stream_options") or {}
        return CompletionRequest(
            prompt_text=text,
            prompt_tokens=count,
            max_tokens=max_tokens,
            stream=bool(body.get("stream", False)),
            include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
            continuous_usage=bool(
                isinstance(options, dict) and options.get("include_usage") and options.get("continuous_usage_stats")
            ),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )

    async def _generate(self, request: CompletionRequest) -> Generation:
        needles, asked = parse_prompt(request.prompt_text)
        answer: str | None = None
        ask = parse_conversation(request.prompt_text)
        if ask is not None:
            capability_p, survival_p = await self.numerics.retrieval_probability(request.prompt_tokens)
            answer = answer_conversation(ask, request.prompt_tokens, capability_p, survival_p, self.config.seed)
        elif asked:
            capability_p, survival_p = await self.numerics.retrieval_probability(request.prompt_tokens)
            answer = answer_needles(needles, asked, request.prompt_tokens, capability_p, survival_p, self.config.seed)
        tokens = self.tokenizer.encode(answer) if answer is not None else []
        if len(tokens) >= request.max_tokens:
            return Generation(tokens[: request.max_tokens], "length")
        if answer is not None and not request.ignore_eos:
            return Generation(tokens, "stop")
        padding = request.max_tokens - len(tokens)
        repeats = -(-padding // len(self._filler_tokens))
        return Generation(tokens + (self._filler_tokens * repeats)[:padding], "length")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """/v1/chat/completions, not streamed: the answer as a message (chat_template_kwargs are accepted and, like
        a template that does not use them, change nothing)."""
        arrival = asyncio.get_running_loop().time()
        completion = self._parse_completion(await _json_object(request), chat=True)
        if completion.stream:
            raise RequestError(400, "the simulator does not stream chat completions", param="stream")
        generation = await self._generate(completion)
        with self._in_flight(completion, generation) as (ttft_ms, gaps_ms):
            await self._sleep_until(arrival, ttft_ms + sum(gaps_ms))
        self._record(completion, generation, ttft_ms, gaps_ms)
        completion_body = self._completion_body(completion, generation)
        [choice] = completion_body["choices"]
        # vLLM 0.32's ChatCompletionResponse, ChatCompletionResponseChoice and ChatMessage as it serializes them
        # (an empty tool_calls is left out; no system_fingerprint).
        message = {"role": "assistant", "content": choice["text"], "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}  # fmt: skip
        chat_choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": choice["finish_reason"],
                       "stop_reason": None, "token_ids": None, "routed_experts": None}  # fmt: skip
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": completion_body["created"],
            "model": self.config.served_model_name,
            "choices": [chat_choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": completion_body["usage"],
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return web.json_response(body)

    @contextlib.contextmanager
    def _in_flight(self, completion: CompletionRequest, generation: Generation) -> Iterator[tuple[float, list[float]]]:
        """A request's simulated TTFT and gaps, counted as running (and its tokens as held) while inside."""
        self._running += 1
        self._active_tokens += completion.prompt_tokens + len(generation.tokens)
        self._update_gauges()
        try:
            yield sample_latencies(self.fit, completion.prompt_tokens, len(generation.tokens), self._running, self._rng)
        finally:
            self._running -= 1
            self._active_tokens -= completion.prompt_tokens + len(generation.tokens)
            self._update_gauges()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        # Simulated time runs from the request's arrival, so parsing a long prompt overlaps the prefill sleep
        # instead of adding real seconds that a time scale would magnify.
        arrival = asyncio.get_running_loop().time()
        completion = self._parse_completion(await _json_object(request))
        generation = await self._generate(completion)
        self._running += 1
        self._active_tokens += completion.prompt_tokens + len(generation.tokens)
        self._update_gauges()
        ttft_ms, gaps_ms = sample_latencies(
            self.fit, completion.prompt_tokens, len(generation.tokens), self._running, self._rng
        )
        try:
            if completion.stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                try:
                    await self._stream(request, response, completion, generation, arrival, ttft_ms, gaps_ms)
                except ConnectionResetError:
                    # The client left mid-stream: vLLM counts the request as aborted.
                    generation = Generation(generation.tokens, "abort")
            else:
                await self._sleep_until(arrival, ttft_ms + sum(gaps_ms))
                response = web.json_response(self._completion_body(completion, generation))
        finally:
            self._running -= 1
            self._active_tokens -= completion.prompt_tokens + len(generation.tokens)
            self._update_gauges()
        self._record(completion, generation, ttft_ms, gaps_ms)
        return response

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        completion: CompletionRequest,
        generation: Generation,
        arrival: float,
        ttft_ms: float,
        gaps_ms: list[float],
    ) -> None:
        await response.prepare(request)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        # The first token is due TTFT after the arrival, each later one at a fixed offset from the first, so
        # per-chunk overhead does not pile up into the ITL and a late first token does not compress the rest.
        loop = asyncio.get_running_loop()
        offsets_ms = np.cumsum([0.0, *gaps_ms])
        last = len(generation.tokens) - 1
        first_sent = arrival
        for index, (token, offset_ms) in enumerate(zip(generation.tokens, offsets_ms, strict=True)):
            if index == 0:
                await self._sleep_until(arrival, ttft_ms)
                first_sent = loop.time()
            else:
                await self._sleep_until(first_sent, float(offset_ms))
            choice = {
                "index": 0,
                "text": self.tokenizer.decode([token]),
                "logprobs": None,
                "finish_reason": generation.finish_reason if index == last else None,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
            chunk = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.config.served_model_name,
            }
            if completion.continuous_usage:
                chunk["usage"] = _usage(completion, generation, generated=index + 1)
            await response.write(_sse({**chunk, "choices": [choice]}))
        if completion.include_usage:
            usage_chunk = {"id": request_id, "object": "text_completion", "created": created}
            usage_chunk |= {
                "model": self.config.served_model_name,
                "choices": [],
                "usage": _usage(completion, generation),
                "system_fingerprint": SYSTEM_FINGERPRINT,
            }
            await response.write(_sse(usage_chunk))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    def _completion_body(self, completion: CompletionRequest, generation: Generation) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": self.tokenizer.decode(generation.tokens),
            "logprobs": None,
            "finish_reason": generation.finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
        usage = {**_usage(completion, generation), "prompt_tokens_details": None, "completion_tokens_details": None}
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    async def _sleep_until(self, arrival: float, simulated_ms: float) -> None:
        """Sleep until `simulated_ms` (scaled by the time scale) after the loop time `arrival`."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, arrival + simulated_ms / 1000 * self.config.time_scale - loop.time()))

    def _update_gauges(self) -> None:
        labels = self.metrics.label_values
        self.metrics.running.labels(**labels).set(self._running)
        self.metrics.kv_usage.labels(**labels).set(min(1.0, self._active_tokens / self._capacity))

    def _record(
        self, completion: CompletionRequest, generation: Generation, ttft_ms: float, gaps_ms: list[float]
    ) -> None:
        """Metrics carry simulated (unscaled) seconds, as the real server would report them."""
        m, labels = self.metrics, self.metrics.label_values
        ttft, decode = ttft_ms / 1000, sum(gaps_ms) / 1000
        m.ttft.labels(**labels).observe(ttft)
        itl = m.itl.labels(**labels)
        for gap in gaps_ms:
            itl.observe(gap / 1000)
        m.e2e.labels(**labels).observe(ttft + decode)
        m.queue.labels(**labels).observe(0.0)
        m.prefill.labels(**labels).observe(ttft)
        m.decode.labels(**labels).observe(decode)
        m.prompt_tokens_hist.labels(**labels).observe(completion.prompt_tokens)
        m.generation_tokens_hist.labels(**labels).observe(len(generation.tokens))
        m.prompt_tokens.labels(**labels).inc(completion.prompt_tokens)
        m.generation_tokens.labels(**labels).inc(len(generation.tokens))
        m.success.labels(**labels, finished_reason=generation.finish_reason).inc()


NO_CHAT_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if the "
    "tokenizer does not define one."
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """ChatML, the template of SmolLM2-135M-Instruct (the real model of tests/realmodel), without its default
    system turn."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _usage(completion: CompletionRequest, generation: Generation, generated: int | None = None) -> dict[str, int]:
    """Token counts of a request: of the whole generation, or of its first `generated` tokens (continuous usage)."""
    generated = len(generation.tokens) if generated is None else generated
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": completion.prompt_tokens + generated,
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError as error:
        raise RequestError(400, f"request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


Handler = Callable[[web.Request], Any]


@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except RequestError as error:
        return error.response()


@contextlib.asynccontextmanager
async def serve(config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Run a simulator in this event loop; yields its base URL once it accepts connections (port 0: a free one)."""
    # Stop promptly: in-flight streams are cut, as when a real server is killed.
    runner = web.AppRunner(Simulator(config).app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        yield f"http://{host}:{bound_port}"
    finally:
        await runner.cleanup()
