"""Misbehaving vLLM-like servers for the gates' failure paths, and an in-process simulator."""

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from kvpolicy.api.v1alpha1 import AccuracyTask
from kvpolicy.gate_programs import niah, tasks
from kvpolicy_dev.sim import serve, tokenizer
from kvpolicy_dev.sim.config import SimConfig

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Room for a 131072-token prompt plus the gate's answer tokens.
MAX_MODEL_LEN = 135168
# Simulator flags for the gate tests: no real waiting, and the fake model's context.
FAST = ["--time-scale", "0.001", "--max-model-len", str(MAX_MODEL_LEN)]
# Gate flags for a test that waits out the client's retries: two quick ones (the default waits 7.5 s in all).
QUICK_RETRIES = ("--retry-delays-seconds", "0.01", "0.01")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A bare environment for gate processes, but with this checkout's sources first (PYTHONPATH), not an installed copy.
CHILD_ENV = {"PATH": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def correct_answer(prompt: str | list[int]) -> str:
    needles, asked = niah.parse_prompt(prompt if isinstance(prompt, str) else tokenizer.decode(prompt))
    return " " + ", ".join(value for key in asked for value in needles[key]) + "."


# The tasks a completion can ask (mrcr is a conversation: chat only).
COMPLETION_TASKS = [name for name in AccuracyTask if not tasks.task(name).chat_only]


def assert_prompt_asks(text: str, sample: niah.TaskSample, question: niah.Question) -> None:
    """A decoded prompt holds each of the sample's needles whole, and its question asks for what `question` expects."""
    needles, asked = niah.parse_prompt(text)
    for needle in sample.needles:
        [(key, value)] = niah.NEEDLE_PATTERN.findall(needle)
        assert value in needles[key], needle
    assert sorted(value for key in asked for value in needles[key]) == sorted(question.expected)


async def answer_correctly(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    return web.json_response({"choices": [{"index": 0, "text": correct_answer(body["prompt"])}]})


@contextlib.asynccontextmanager
async def fake_vllm(completions: Handler, max_model_len: int = MAX_MODEL_LEN) -> AsyncIterator[str]:
    """A server with vLLM's /v1/models and /tokenize whose /v1/completions misbehaves as told."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL, "max_model_len": max_model_len}]})

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": tokenizer.encode((await request.json())["prompt"])})

    app = web.Application(client_max_size=2**26)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def hang(_: web.Request) -> web.StreamResponse:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


async def garbage(_: web.Request) -> web.StreamResponse:
    return web.Response(text="<html>oops</html>", content_type="application/json")


async def truncated(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "1000"})
    await response.prepare(request)
    await response.write(b'{"choices": [{"te')
    assert request.transport is not None
    request.transport.close()
    return response


def flaky(failures: int) -> Handler:
    """Answer 503 `failures` times, then correctly."""
    remaining = [failures]

    async def handler(request: web.Request) -> web.StreamResponse:
        if remaining[0] > 0:
            remaining[0] -= 1
            return web.json_response({"error": {"message": "engine restarting"}}, status=503)
        return await answer_correctly(request)

    return handler


@contextlib.asynccontextmanager
async def in_process_simulator(**overrides: object) -> AsyncIterator[str]:
    config = SimConfig(**{"served_model_name": MODEL, "time_scale": 0.0, "max_model_len": MAX_MODEL_LEN, **overrides})
    async with serve(config) as url:
        yield url


def run_gate(gate: str, canary: str, baseline: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    """`kvpolicy gate GATE` as a child process: its exit code and JSON, checked against the termination log."""
    log = tmp_path / "termination-log"
    completed = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "gate", gate, "--canary", canary, "--baseline", baseline, *extra],
        capture_output=True,
        text=True,
        env={**CHILD_ENV, "KVPOLICY_TERMINATION_LOG": str(log)},
        timeout=300,
    )
    result: dict = json.loads(completed.stdout)
    assert json.loads(log.read_text()) == result
    assert len(log.read_bytes()) <= 4096
    return completed.returncode, result
