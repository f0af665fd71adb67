"""The accuracy gate against simulators serving each tokenizer family: exact prompts and a verdict with every one."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from gate_fakes import MODEL, assert_prompt_asks, in_process_simulator
from kvpolicy.api.v1alpha1 import AccuracyTask
from kvpolicy.gate_programs import tasks
from kvpolicy.gate_programs.accuracy import AccuracyOptions, run_accuracy_gate, shared_pieces, sized_prompts
from kvpolicy.gate_programs.client import VllmClient
from kvpolicy_dev.sim.tokenizer_zoo import Family
from tokenizer_families import FAMILIES, LocalTokenizer


@pytest.mark.parametrize("family", FAMILIES, ids=str)
@pytest.mark.parametrize("length", [517, 4099, 33333])
async def test_every_family_gets_prompts_of_exactly_the_length_the_server_counts(
    family: Family, length: int, model_dirs: dict[Family, Path]
) -> None:
    task = tasks.task(AccuracyTask.MULTIQUERY, asked=4)
    sample = task.draw(4, length)
    async with in_process_simulator(tokenizer=model_dirs[family]) as url, aiohttp.ClientSession() as session:
        client = VllmClient(session, url, MODEL, timeout_s=60)
        shared = await shared_pieces(client, task, 4)
        [prompt] = await sized_prompts(client, shared, sample, length)
        completion = await client.complete(prompt, 4)
    assert len(prompt) == length and completion.prompt_tokens == length
    assert_prompt_asks(LocalTokenizer(family).decode(prompt), sample, sample.questions[0])


@pytest.mark.parametrize("family", FAMILIES, ids=str)
async def test_the_gate_passes_a_bf16_canary_with_every_family(family: Family, model_dirs: dict[Family, Path]) -> None:
    async with (
        in_process_simulator(tokenizer=model_dirs[family]) as canary,
        in_process_simulator(tokenizer=model_dirs[family]) as baseline,
    ):
        result = await run_accuracy_gate(AccuracyOptions(canary, baseline, 4099, MODEL))
    assert (result["verdict"], result["reason"]) == ("Pass", "RecoveryAboveThreshold"), result["message"]
    assert result["canaryScore"] == result["baselineScore"] > 0.9


async def test_the_gate_fails_unfixed_fp8_at_128k_with_a_lossy_wordpiece_tokenizer(
    model_dirs: dict[Family, Path],
) -> None:
    tokenizer = model_dirs[Family.WORDPIECE]
    async with (
        in_process_simulator(tokenizer=tokenizer, kv_cache_dtype="fp8") as canary,
        in_process_simulator(tokenizer=tokenizer) as baseline,
    ):
        result = await run_accuracy_gate(AccuracyOptions(canary, baseline, 131072, MODEL))
    assert (result["verdict"], result["reason"]) == ("Fail", "RecoveryBelowThreshold"), result["message"]
    assert result["recoveryHigh"] < 0.95


async def test_canary_and_baseline_with_different_tokenizers_are_inconclusive(model_dirs: dict[Family, Path]) -> None:
    async with (
        in_process_simulator(tokenizer=model_dirs[Family.WORDPIECE]) as canary,
        in_process_simulator(tokenizer=model_dirs[Family.BYTE_LEVEL_BPE]) as baseline,
    ):
        result = await run_accuracy_gate(AccuracyOptions(canary, baseline, 2048, MODEL))
    assert (result["verdict"], result["reason"]) == ("Inconclusive", "TokenizerMismatch")
