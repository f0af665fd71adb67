"""A small client for vLLM's OpenAI-compatible API, with an API key and retries for transient failures.

Connection errors, timeouts, 5xx answers and malformed or truncated bodies are retried with backoff; after the last
attempt they raise `EndpointUnavailable`. A 4xx answer is the server refusing the request: `RequestRejected`
(`Unauthorized` for 401/403), not retried. Messages go into the gate's result, which reaches the policy's status:
they hold status codes and fixed reasons, never what the server sent (that is logged on stderr).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

from kvpolicy.api.reasons import GateReason
from kvpolicy.credentials import Credentials, CredentialsError
from kvpolicy.http_errors import connection_problem, status_text

T = TypeVar("T")
# 7.5 s in all: long enough to ride out a baseline pod replaced under the gate (a user's edit rolling the target: the
# request in flight fails and the Service's endpoints move to the new, already ready pod), short enough that a dead
# endpoint still ends the gate in seconds.
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
log = logging.getLogger(__name__)


class GateError(Exception):
    """Ends the gate as Inconclusive with a reason code."""

    def __init__(self, reason: GateReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EndpointUnavailable(GateError):
    """The endpoint kept failing (down, hanging, 5xx, or answering garbage)."""

    def __init__(self, message: str) -> None:
        super().__init__(GateReason.ENDPOINT_UNAVAILABLE, message)


class RequestRejected(GateError):
    """The endpoint answered 4xx."""

    def __init__(self, message: str, reason: GateReason = GateReason.REQUEST_REJECTED) -> None:
        super().__init__(reason, message)


class Unauthorized(RequestRejected):
    """The endpoint answered 401 or 403: no API key, or the wrong one."""

    def __init__(self, message: str) -> None:
        super().__init__(message, GateReason.UNAUTHORIZED)


class _Transient(Exception):
    pass


def base_url(text: str, flag: str) -> str:
    """A server's base URL from what a person types, `http(s)://host[:port][/prefix][/v1]` (the OpenAI SDK's `/v1`
    is dropped: vLLM serves /tokenize and /health beside it); ValueError names `flag` and says what to write."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or "://" not in text:
        example = text.split("://")[-1] or "HOST:PORT"
        raise ValueError(f"{flag} {text!r} is not an http(s) URL: write it as http://{example}")
    try:
        parts.port  # noqa: B018  (parsing the port is the check)
    except ValueError:
        raise ValueError(f"{flag} {text!r} has an invalid port: use a number from 1 to 65535") from None
    if not parts.hostname:
        raise ValueError(f"{flag} {text!r} names no host: write it as http://HOST:PORT")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{flag} must not carry credentials in the URL: give the API key with --api-key-file")
    if parts.query or parts.fragment:
        raise ValueError(f"{flag} {text!r} has a query or fragment: give only http(s)://host[:port][/path]")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True)
class StreamTiming:
    """Client-side arrival times of one streamed completion's chunks, in seconds from sending the request, and how
    many tokens had been generated when each arrived. vLLM sends a chunk per token only while the client keeps up:
    tokens generated before the last chunk was picked up are sent together (seen on a loaded 2-core machine), so a
    chunk's index is not its token's."""

    arrivals_s: tuple[float, ...]
    tokens_so_far: tuple[int, ...]

    @property
    def ttft_s(self) -> float:
        return self.arrivals_s[0]

    @property
    def itl_s(self) -> float:
        """Mean gap between tokens as the Theil-Sen slope of arrival time against token count (the median of all
        pairwise slopes). A stalled client or server delays a run of chunks and then catches up in a burst; those
        late points bend a least-squares line or last - first, but not a median."""
        times, counts = np.asarray(self.arrivals_s), np.asarray(self.tokens_so_far)
        first, second = np.triu_indices(len(times), k=1)
        return float(np.median((times[second] - times[first]) / (counts[second] - counts[first])))


def _completion_tokens(usage: object, previous: int) -> int:
    """Tokens generated so far by a chunk's continuous usage; one more than before from a server that sends none."""
    count = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return count if isinstance(count, int) and count > previous else previous + 1


def open_session(credentials: Credentials | None) -> aiohttp.ClientSession:
    """A session trusting the credentials' CA bundle (the system's without credentials)."""
    connector = aiohttp.TCPConnector(ssl=credentials.ssl_context) if credentials is not None else None
    return aiohttp.ClientSession(connector=connector)


def _server_says(body: str) -> str:
    """The server's own error message, for the log only."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])[:300]
    return body[:300]


@dataclass(frozen=True)
class Completion:
    text: str
    # What the server counted (usage.prompt_tokens); None when it does not say.
    prompt_tokens: int | None


def _completion(body: dict[str, Any], text_of: Callable[[Any], object], where: str) -> Completion:
    """An answer's text (`text_of` the first choice, found at `where`) and the prompt tokens the server counted;
    _Transient (retried) when the body has no text there."""
    try:
        text = text_of(body["choices"][0])
    except (KeyError, IndexError, TypeError) as error:
        raise _Transient(f"answer without {where}") from error
    if not isinstance(text, str):
        raise _Transient(f"{where} is not a string")
    usage = body.get("usage")
    counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return Completion(text, counted if isinstance(counted, int) else None)


class VllmClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        model: str,
        timeout_s: float,
        retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S,
        credentials: Credentials | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._retry_delays_s = retry_delays_s
        self._credentials = credentials

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._credentials is not None:
            try:
                headers |= self._credentials.headers()
            except CredentialsError as error:
                raise GateError(GateReason.CREDENTIALS_UNREADABLE, str(error)) from None
        return headers

    def _refused(self, path: str, status: int, body: str) -> Exception:
        """The exception for an error answer: retried if 5xx; the server's words go to the log only."""
        said = _server_says(body)
        log.warning(
            "%s%s answered HTTP %d: %s",
            self.base_url,
            path,
            status,
            self._credentials.redact(said) if self._credentials else said,
        )
        if status >= 500:
            return _Transient(status_text(status))
        message = f"{path} at {self.base_url}: {status_text(status)}"
        if status in (401, 403):
            if self._credentials is None or self._credentials.source.bearer_token is None:
                return Unauthorized(f"{message}: it wants an API key (give one with --api-key-file or --api-key-env)")
            return Unauthorized(f"{message}: it refused the API key given")
        return RequestRejected(message)

    async def _with_retries(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        last_problem = ""
        for delay in (*self._retry_delays_s, None):
            try:
                return await attempt()
            except aiohttp.ClientError as error:
                last_problem = f"{type(error).__name__}: {connection_problem(error)}"
            except (TimeoutError, _Transient) as error:
                last_problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            if delay is not None:
                await asyncio.sleep(delay)
        attempts = len(self._retry_delays_s) + 1
        raise EndpointUnavailable(f"{what} at {self.base_url} failed {attempts} times; last: {last_problem}")

    async def _request_json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = None if body is None else json.dumps(body).encode()

        async def attempt() -> dict[str, Any]:
            async with self._session.request(
                method, self.base_url + path, data=payload, headers=self._headers(), timeout=self._timeout
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise self._refused(path, response.status, text)
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
        log.warning("%s serves %s", self.base_url, served or "no model")
        raise RequestRejected(f"{self.base_url} does not serve model {self.model!r} (the log lists what it serves)")

    def _token_ids(self, body: dict[str, Any]) -> list[int]:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
            raise EndpointUnavailable(f"/tokenize at {self.base_url} returned no list of token ids")
        return tokens

    async def tokenize(self, prompt: str, add_special_tokens: bool) -> list[int]:
        """The server's token ids for `prompt`, with or without the special tokens it adds to a text prompt."""
        request = {"model": self.model, "prompt": prompt, "add_special_tokens": add_special_tokens}
        return self._token_ids(await self._request_json("POST", "/tokenize", request))

    async def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The server's token ids for a chat through its chat template, with the assistant's generation prompt: the
        prompt /v1/chat/completions will run for these messages."""
        request = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return self._token_ids(await self._request_json("POST", "/tokenize", request))

    async def has_chat_template(self) -> bool:
        """Whether the served model has a chat template. vLLM 0.32 says so nowhere else (/v1/models does not;
        /tokenizer_info is off by default): /tokenize with messages answers 400 without one ("default chat template
        is no longer allowed"), token ids with one."""
        try:
            await self.tokenize_chat([{"role": "user", "content": "Hello."}])
        except Unauthorized:
            raise
        except RequestRejected:
            return False
        return True

    async def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Completion:
        """A greedy chat completion through the server's chat template, thinking off for reasoning models."""
        request = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": False},
        }

        async def attempt() -> Completion:
            body = await self._request_json("POST", "/v1/chat/completions", request)
            return _completion(body, lambda choice: choice["message"]["content"], "choices[0].message.content")

        return await self._with_retries("POST /v1/chat/completions", attempt)

    async def metrics_text(self) -> str:
        """The server's Prometheus page (/metrics), as text."""

        async def attempt() -> str:
            async with self._session.get(
                self.base_url + "/metrics", headers=self._headers(), timeout=self._timeout
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise self._refused("/metrics", response.status, text)
                return text

        return await self._with_retries("GET /metrics", attempt)

    async def complete(self, prompt: str | list[int], max_tokens: int) -> Completion:
        request = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}

        async def attempt() -> Completion:
            body = await self._request_json("POST", "/v1/completions", request)
            return _completion(body, lambda choice: choice["text"], "choices[0].text")

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
            # vLLM's per-chunk usage: how many tokens a chunk completes, when several were sent together.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }

        # Serialised once, outside the timed span: a long prompt's JSON would otherwise count as prefill.
        payload_bytes = json.dumps(request).encode()

        async def attempt() -> StreamTiming:
            arrivals: list[float] = []
            tokens_so_far: list[int] = []
            done = False
            headers = self._headers()
            start = time.perf_counter()
            async with self._session.post(
                self.base_url + "/v1/completions", data=payload_bytes, headers=headers, timeout=self._timeout
            ) as response:
                if response.status >= 400:
                    raise self._refused("/v1/completions", response.status, await response.text())
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[len(b"data:") :].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(payload)
                        choices = chunk["choices"]
                        if choices and not isinstance(choices[0]["text"], str):
                            raise TypeError("text is not a string")
                    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
                        raise _Transient("malformed stream chunk") from error
                    # A chunk with choices carries new tokens (with empty text while a token ends inside a character,
                    # byte-level BPE); one without choices carries only the final usage.
                    if choices:
                        previous = tokens_so_far[-1] if tokens_so_far else 0
                        tokens_so_far.append(_completion_tokens(chunk.get("usage"), previous))
                        arrivals.append(time.perf_counter() - start)
            if not done or len(arrivals) < 2:
                raise _Transient("the stream ended without [DONE] or with fewer than two chunks of tokens")
            return StreamTiming(tuple(arrivals), tuple(tokens_so_far))

        return await self._with_retries("streaming POST /v1/completions", attempt)
