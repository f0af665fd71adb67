"""The accuracy gate against simulators and misbehaving servers over loopback HTTP."""

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from gate_fakes import (
    COMPLETION_TASKS,
    MODEL,
    QUICK_RETRIES,
    answer_correctly,
    assert_prompt_asks,
    fake_vllm,
    flaky,
    garbage,
    hang,
    in_process_simulator,
    run_gate,
    truncated,
)
from kvpolicy.api.v1alpha1 import AccuracyTask
from kvpolicy.gate_programs import tasks
from kvpolicy.gate_programs.accuracy import AccuracyOptions, run_accuracy_gate, shared_pieces, sized_prompts
from kvpolicy.gate_programs.client import VllmClient
from kvpolicy_dev.sim import free_port

RESULT_KEYS = {
    "gate", "task", "promptFormat", "verdict", "reason", "message", "lengthTokens", "samples", "canaryScore",
    "baselineScore", "recovery", "recoveryLow", "recoveryHigh", "minRecovery", "confidence", "baselineFloor",
}  # fmt: skip


def gate_cli(canary: str, baseline: str, length: int, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    code, result = run_gate("accuracy", canary, baseline, tmp_path, "--length", str(length), "--model", MODEL, *extra)
    assert set(result) == RESULT_KEYS
    return code, result


def options(canary: str, baseline: str, length: int, **overrides: object) -> AccuracyOptions:
    return AccuracyOptions(
        **{
            "canary": canary,
            "baseline": baseline,
            "length": length,
            "model": MODEL,
            "retry_delays_s": (0.01, 0.01),
            **overrides,
        }
    )


def test_unfixed_fp8_on_h100_fails_at_128k(simulators: dict[str, str], tmp_path: Path) -> None:
    code, result = gate_cli(simulators["unfixed"], simulators["bf16"], 131072, tmp_path)
    assert (code, result["verdict"], result["reason"]) == (1, "Fail", "RecoveryBelowThreshold")
    assert result["recoveryHigh"] < 0.95 and result["lengthTokens"] == 131072
    assert result["canaryScore"] < result["baselineScore"]


def test_unfixed_fp8_on_h100_passes_at_16k(simulators: dict[str, str], tmp_path: Path) -> None:
    code, result = gate_cli(simulators["unfixed"], simulators["bf16"], 16384, tmp_path)
    assert (code, result["verdict"]) == (0, "Pass")
    assert result["recoveryLow"] >= 0.95


# The 128k probabilities of B200 and BF16 canaries are checked in tests/sim; here the gate runs them cheaper, at 16k.
@pytest.mark.parametrize(("canary", "length"), [("fixed", 131072), ("b200", 16384), ("bf16", 16384)])
def test_canaries_without_the_hopper_shrink_pass(
    canary: str, length: int, simulators: dict[str, str], tmp_path: Path
) -> None:
    code, result = gate_cli(simulators[canary], simulators["bf16"], length, tmp_path)
    assert (code, result["verdict"]) == (0, "Pass")
    # Sequential stopping: well under the 100-prompt cap.
    assert result["samples"] < 40


def test_a_gate_that_cannot_decide_within_the_cap_is_inconclusive(simulators: dict[str, str], tmp_path: Path) -> None:
    code, result = gate_cli(simulators["fixed"], simulators["bf16"], 4096, tmp_path, "--max-samples", "4")
    assert (code, result["verdict"], result["reason"], result["samples"]) == (2, "Inconclusive", "SampleCapReached", 4)


def test_length_above_max_model_len_is_inconclusive(simulators: dict[str, str], tmp_path: Path) -> None:
    code, result = gate_cli(simulators["fixed"], simulators["bf16"], 200000, tmp_path)
    assert (code, result["verdict"], result["reason"]) == (2, "Inconclusive", "LengthExceedsMaxModelLen")
    assert "--max-model-len" in result["message"]


def test_unreachable_endpoint_is_inconclusive_never_a_pass(simulators: dict[str, str], tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # Quick retries: what is shown is the verdict after the last of them.
    code, result = gate_cli(dead, simulators["bf16"], 4096, tmp_path, *QUICK_RETRIES)
    assert (code, result["verdict"], result["reason"]) == (2, "Inconclusive", "EndpointUnavailable")
    assert dead in result["message"] and "failed 3 times" in result["message"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--length", "0"], "--length must be positive, got 0"),
        (
            ["--length", "4096", "--confidence", "1.5"],
            "--confidence 1.5: a KVPolicy refuses it (gates.accuracy.confidence must be a number in (0, 1)",
        ),
        (
            ["--length", "4096", "--baseline-floor", "1"],
            "--baseline-floor 1.0: a KVPolicy refuses it (gates.accuracy.baselineFloor must be a number in [0, 1)",
        ),
        (["--length", "4096", "--asked", "9"], "--asked must be between 1 and --needles (8), got 9"),
        (["--length", "many"], "argument --length: invalid int value: 'many'"),
        (["--length", "4096", "--api-key-file", "/nonexistent/key"], "cannot read the bearer token from file"),
        (["--length", "4096", "--api-key-env", "KVPOLICY_TEST_UNSET"], "environment variable KVPOLICY_TEST_UNSET"),
        (["--length", "4096", "--retry-delays-seconds", "1", "-1"], "--retry-delays-seconds must be zero or more"),
    ],
)
def test_bad_arguments_exit_64_with_a_message(argv: list[str], fragment: str) -> None:
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "kvpolicy", "gate", "accuracy", "--canary", "http://x", "--baseline", "http://y"),
            *("--model", MODEL, *argv),
        ],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 64
    assert fragment in completed.stderr
    assert "usage: kvpolicy gate accuracy" in completed.stderr and "Traceback" not in completed.stderr
    assert completed.stdout == ""


@pytest.mark.parametrize(
    ("behaviour", "reason"), [(garbage, "EndpointUnavailable"), (truncated, "EndpointUnavailable")]
)
async def test_malformed_or_truncated_answers_are_inconclusive(behaviour: object, reason: str) -> None:
    async with fake_vllm(behaviour) as bad, fake_vllm(answer_correctly) as good:
        result = await run_accuracy_gate(options(bad, good, 2048))
    assert (result["verdict"], result["reason"]) == ("Inconclusive", reason)
    assert bad in result["message"] and "failed 3 times" in result["message"]


async def test_a_hanging_server_times_out_and_is_inconclusive() -> None:
    async with fake_vllm(hang) as stuck, fake_vllm(answer_correctly) as good:
        result = await run_accuracy_gate(options(stuck, good, 2048, request_timeout_seconds=0.3))
    assert (result["verdict"], result["reason"]) == ("Inconclusive", "EndpointUnavailable")
    assert "TimeoutError" in result["message"]


async def test_transient_5xx_is_retried_and_the_gate_still_decides() -> None:
    async with fake_vllm(flaky(failures=2)) as shaky, fake_vllm(answer_correctly) as good:
        result = await run_accuracy_gate(options(shaky, good, 2048))
    assert (result["verdict"], result["canaryScore"]) == ("Pass", 1.0)


async def test_a_model_the_server_does_not_serve_is_reported() -> None:
    async with fake_vllm(answer_correctly) as good:
        result = await run_accuracy_gate(options(good, good, 2048, model="other/model"))
    assert (result["verdict"], result["reason"]) == ("Inconclusive", "RequestRejected")
    assert "does not serve model 'other/model'" in result["message"]


@pytest.mark.parametrize("name", COMPLETION_TASKS)
@pytest.mark.parametrize("length", [699, 5001, 65536])
async def test_prompts_are_exactly_the_requested_tokens_with_every_needle_whole(
    length: int, name: AccuracyTask
) -> None:
    task = tasks.task(name, needles=8, asked=4)
    sample = task.draw(2, 1)
    async with in_process_simulator() as url, aiohttp.ClientSession() as session:
        client = VllmClient(session, url, MODEL, timeout_s=30)
        prompts = await sized_prompts(client, await shared_pieces(client, task, 2), sample, length)
        for prompt, question in zip(prompts, sample.questions, strict=True):
            completion = await client.complete(prompt, 8)
            async with session.post(f"{url}/detokenize", json={"tokens": prompt}) as response:
                text = (await response.json())["prompt"]
            assert len(prompt) == length and completion.prompt_tokens == length
            assert_prompt_asks(text, sample, question)
    assert len(prompts) == (4 if name == AccuracyTask.MULTIKEY else 1)


async def test_a_length_too_short_for_the_needles_is_inconclusive() -> None:
    async with in_process_simulator() as url:
        result = await run_accuracy_gate(options(url, url, 100))
    assert (result["verdict"], result["reason"]) == ("Inconclusive", "LengthTooShort")


async def answer_nothing(_: web.Request) -> web.StreamResponse:
    return web.json_response({"choices": [{"index": 0, "text": " I cannot find them."}]})


async def test_a_baseline_that_finds_no_needle_is_too_weak_to_judge_with_advice() -> None:
    async with fake_vllm(answer_nothing) as blind, fake_vllm(answer_correctly) as good:
        result = await run_accuracy_gate(options(good, blind, 2048))
    assert (result["verdict"], result["reason"], result["baselineScore"]) == ("Inconclusive", "BaselineTooWeak", 0.0)
    # Shown below the floor long before the cap, and the message says what to change.
    assert result["samples"] < 10
    assert "easier task" in result["message"] and "shorter length" in result["message"]
