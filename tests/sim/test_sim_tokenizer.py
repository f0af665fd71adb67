"""`kvpolicy sim --tokenizer`: the simulator tokenizes as the Hugging Face tokenizer it is given, special tokens too."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from kvpolicy_dev.sim import SimConfig, serve, start_simulator_subprocess
from kvpolicy_dev.sim.tokenizer_zoo import Family, build
from tokenizers import Tokenizer

MODEL = "test/model"
TEXT = "Some special magic numbers are hidden. One of them for rustic-glacier is: 3908710."


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> dict[Family, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    files = {}
    for family in Family:
        files[family] = root / f"{family.value}.json"
        build(family).save(str(files[family]))
    return files


async def post(session: aiohttp.ClientSession, url: str, body: object) -> dict:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return dict(await response.json())


@pytest.mark.parametrize("family", list(Family), ids=str)
async def test_tokenize_and_prompt_counts_are_the_tokenizers_own(family: Family, tokenizer_files: dict) -> None:
    reference = Tokenizer.from_file(str(tokenizer_files[family]))
    config = SimConfig(served_model_name=MODEL, time_scale=0.0, max_model_len=4096, tokenizer=tokenizer_files[family])
    async with serve(config) as url, aiohttp.ClientSession() as session:
        with_special = await post(session, f"{url}/tokenize", {"model": MODEL, "prompt": TEXT})
        without = await post(session, f"{url}/tokenize", {"prompt": TEXT, "add_special_tokens": False})
        completion = await post(session, f"{url}/v1/completions", {"prompt": TEXT, "max_tokens": 2})
        as_ids = await post(session, f"{url}/v1/completions", {"prompt": without["tokens"], "max_tokens": 2})
    assert with_special["tokens"] == reference.encode(TEXT, add_special_tokens=True).ids
    assert without["tokens"] == reference.encode(TEXT, add_special_tokens=False).ids
    # A text prompt gets the special tokens, as vLLM's does; ids are taken as they are.
    assert completion["usage"]["prompt_tokens"] == len(with_special["tokens"])
    assert as_ids["usage"]["prompt_tokens"] == len(without["tokens"])


async def test_ids_outside_the_vocabulary_are_refused(tokenizer_files: dict) -> None:
    file = tokenizer_files[Family.WORDPIECE]
    config = SimConfig(served_model_name=MODEL, time_scale=0.0, max_model_len=4096, tokenizer=file)
    size = Tokenizer.from_file(str(file)).get_vocab_size()
    async with serve(config) as url, aiohttp.ClientSession() as session:
        response = await session.post(f"{url}/v1/completions", json={"prompt": [1, size], "max_tokens": 2})
        assert response.status == 400
        assert f"token id {size} is outside the vocabulary" in (await response.json())["error"]["message"]


def test_a_model_directory_serves_from_a_subprocess(tokenizer_files: dict, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_files[Family.UNIGRAM].read_bytes())
    body = json.dumps({"prompt": "hello"}).encode()
    with start_simulator_subprocess(["--tokenizer", str(tmp_path), "--time-scale", "0"]) as url:
        request = urllib.request.Request(f"{url}/tokenize", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            tokens = json.load(response)["tokens"]
    assert tokens == Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("hello").ids


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "no tokenizer.json there"), ("{not json", "is not a tokenizer.json")],
)
def test_a_missing_or_malformed_tokenizer_is_refused_before_serving(
    content: str | None, fragment: str, tmp_path: Path
) -> None:
    if content is not None:
        (tmp_path / "tokenizer.json").write_text(content)
    completed = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "sim", "--tokenizer", str(tmp_path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert f"--tokenizer {tmp_path}: " in completed.stderr and fragment in completed.stderr
    assert "Traceback" not in completed.stderr
