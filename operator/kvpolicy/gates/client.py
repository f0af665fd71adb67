"""A small client for vLLM's OpenAI-compatible API with retries for transient failures.

Connection errors, timeouts, 5xx answers and malformed or truncated bodies are retried with backoff; after the last
attempt they raise `EndpointUnavailable`. A 4xx answer is the server refusing the request: `RequestRejected`, not
retried.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np

T = TypeVar("T")
RETRY_DELAYS_S = (0.2, 0.5, 1.0)


class EndpointUnavailable(Exception):
    """The endpoint kept failing (down, hanging, 5xx, or answering garbage)."""


class RequestRejected(Exception):
    """The endpoint answered 4xx; the message is the server's."""


class _Transient(Exception):
    pass


@dataclass(frozen=True)
class StreamTiming:
    """Client-side arrival times of one streamed completion's tokens, in seconds from sending the request."""

    arrivals_s: tuple[float, ...]

    @property
    def ttft_s(self) -> float:
        return self.arrivals_s[0]

    @property
    def itl_s(self) -> float:
        """Mean gap between tokens as the Theil-Sen slope of arrival time against token index (the median of all
        pairwise slopes). A stalled client or server delays a run of chunks and then catches up in a burst; those
        late points bend a least-squares line or last - first, but not a median."""
        times = np.asarray(self.arrivals_s)
        first, second = np.triu_indices(len(times), k=1)
        return float(np.median((times[second] - times[first]) / (second - first)))


def _error_message(body: str) -> str:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return body[:300]


class VllmClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        model: str,
        timeout_s: float,
        retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._retry_delays_s = retry_delays_s

    async def _with_retries(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        last_problem = ""
        for delay in (*self._retry_delays_s, None):
            try:
                return await attempt()
            except (aiohttp.ClientError, TimeoutError, _Transient) as error:
                last_problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            if delay is not None:
                await asyncio.sleep(delay)
        attempts = len(self._retry_delays_s) + 1
        raise EndpointUnavailable(f"{what} at {self.base_url} failed {attempts} times; last: {last_problem}")

    async def _request_json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async def attempt() -> dict[str, Any]:
            async with self._session.request(
                method, self.base_url + path, json=body, timeout=self._timeout
            ) as response:
                text = await response.text()
                if response.status >= 500:
                    raise _Transient(f"HTTP {response.status}: {_error_message(text)}")
                if response.status >= 400:
                    raise RequestRejected(f"{path} at {self.base_url}: HTTP {response.status}: {_error_message(text)}")
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError as error:
                    raise _Transient(f"malformed JSON from {path}: {error}") from error
                if not isinstance(parsed, dict):
                    raise _Transient(f"{path} answered {type(parsed).__name__}, not a JSON object")
                return parsed

        return await self._with_retries(f"{method} {path}", attempt)

    async def max_model_len(self) -> int:
        """The served model's max_model_len; RequestRejected if this endpoint does not serve `model`."""
        body = await self._request_json("GET", "/v1/models")
        cards = body.get("data")
        if not isinstance(cards, list):
            raise EndpointUnavailable(f"/v1/models at {self.base_url} has no 'data' list")
        for card in cards:
            if isinstance(card, dict) and card.get("id") == self.model:
                limit = card.get("max_model_len")
                if not isinstance(limit, int):
                    raise EndpointUnavailable(f"/v1/models at {self.base_url} gives no max_model_len for {self.model}")
                return limit
        served = ", ".join(str(card.get("id")) for card in cards if isinstance(card, dict))
        raise RequestRejected(f"{self.base_url} does not serve model {self.model!r} (it serves: {served or 'none'})")

    async def tokenize(self, prompt: str) -> list[int]:
        body = await self._request_json("POST", "/tokenize", {"model": self.model, "prompt": prompt})
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise EndpointUnavailable(f"/tokenize at {self.base_url} returned no token list")
        return tokens

    async def complete(self, prompt: str | list[int], max_tokens: int) -> str:
        request = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}

        async def attempt() -> str:
            body = await self._request_json("POST", "/v1/completions", request)
            try:
                text = body["choices"][0]["text"]
            except (KeyError, IndexError, TypeError) as error:
                raise _Transient(f"completion without choices[0].text: {str(body)[:200]}") from error
            if not isinstance(text, str):
                raise _Transient("completion text is not a string")
            return text

        return await self._with_retries("POST /v1/completions", attempt)

    async def stream_timing(self, prompt: str | list[int], max_tokens: int) -> StreamTiming:
        """Stream one completion (ignore_eos, like `vllm bench serve`) and time its token chunks."""
        request = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }

        # Serialised once, outside the timed span: a long prompt's JSON would otherwise count as prefill.
        payload_bytes = json.dumps(request).encode()
        headers = {"Content-Type": "application/json"}

        async def attempt() -> StreamTiming:
            arrivals: list[float] = []
            done = False
            start = time.perf_counter()
            async with self._session.post(
                self.base_url + "/v1/completions", data=payload_bytes, headers=headers, timeout=self._timeout
            ) as response:
                if response.status >= 400:
                    message = _error_message(await response.text())
                    if response.status >= 500:
                        raise _Transient(f"HTTP {response.status}: {message}")
                    raise RequestRejected(f"/v1/completions at {self.base_url}: HTTP {response.status}: {message}")
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[len(b"data:") :].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    try:
                        text = json.loads(payload)["choices"][0]["text"]
                    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
                        raise _Transient(f"malformed stream chunk: {payload[:200]!r}") from error
                    if text:
                        arrivals.append(time.perf_counter() - start)
            if not done or len(arrivals) < 2:
                raise _Transient("the stream ended without [DONE] or with fewer than two tokens")
            return StreamTiming(tuple(arrivals))

        return await self._with_retries("streaming POST /v1/completions", attempt)
