"""The accuracy gate's tasks (gate_programs/tasks.py, ruler.py): RULER's templates, answer prefix and string_match_all
against hand-written cases, MRCR's format and grade, chat prompts sized to the longest that fits, every task of the
CRD's enum in the registry, and, through `kvpolicy gate accuracy` against simulators, an H200 canary without two-level
accumulation failing at 128k on every task (mrcr as a chat) and promptFormat Auto choosing by the chat template."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from gate_fakes import FAST, MODEL, in_process_simulator, run_gate
from kvpolicy.api.v1alpha1 import AccuracyGate, AccuracyTask, PromptFormat
from kvpolicy.gate_programs import mrcr, niah, ruler, tasks
from kvpolicy.gate_programs.accuracy import shared_pieces, sized_chat, sized_prompts
from kvpolicy.gate_programs.client import VllmClient
from kvpolicy_dev.sim import start_simulator_subprocess
from kvpolicy_dev.sim.accuracy import answer_needles
from kvpolicy_dev.sim.tokenizer_zoo import Family
from pydantic import ValidationError
from tokenizer_families import LocalTokenizer

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SINGLE_QUESTION = (
    "\nWhat is the special magic number for amber-anchor mentioned in the provided text? The special magic number for "
    "amber-anchor mentioned in the provided text is"
)


def test_every_task_the_crd_names_is_registered_and_the_default_is_the_mix() -> None:
    assert set(tasks.TASKS) == set(AccuracyTask)
    assert AccuracyGate().task == AccuracyTask.MULTIKEY
    for name in AccuracyTask:
        assert tasks.task(name).name == name


def test_rulers_singular_template_for_one_value() -> None:
    # RULER's template with its answer prefix, after its own replacements (Some -> A, are all -> is, are -> is).
    assert ruler.NIAH_SINGLE_1.header() == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
        "the number afterwards."
    )
    assert ruler.NIAH_SINGLE_1.question(["amber-anchor"]) == SINGLE_QUESTION
    assert ruler.NIAH_SINGLE_1.needle("amber-anchor", "1234567") == (
        "\nOne of the special magic numbers for amber-anchor is: 1234567."
    )
    uuid_key = "0b1c2d3e-1111-4222-8333-444455556666"
    assert ruler.NIAH_MULTIKEY_3.header().endswith("I will quiz you about the uuid afterwards.")
    assert ruler.NIAH_MULTIKEY_3.question([uuid_key]).startswith(f"\nWhat is the special magic uuid for {uuid_key} ")
    assert ruler.NIAH_MULTIKEY_3.needle(uuid_key, "v").startswith("\nOne of the special magic uuids for ")


def test_rulers_plural_template_and_query_list() -> None:
    assert ruler.NIAH_MULTIQUERY.header() == (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the numbers afterwards."
    )
    assert ruler.NIAH_MULTIQUERY.question(["a-b", "c-d", "e-f", "g-h"]) == (
        "\nWhat are all the special magic numbers for a-b, c-d, e-f, and g-h mentioned in the provided text? The "
        "special magic numbers for a-b, c-d, e-f, and g-h mentioned in the provided text are"
    )
    assert ruler.NIAH_MULTIVALUE.question(["a-b"]).endswith("for a-b mentioned in the provided text are")


@pytest.mark.parametrize(
    ("name", "needles", "asked", "expected", "haystack"),
    [
        (AccuracyTask.NIAH_SINGLE_1, 1, 1, 1, ruler.Haystack.NOISE),
        (AccuracyTask.NIAH_MULTIKEY_2, 1, 1, 1, ruler.Haystack.NEEDLE),
        (AccuracyTask.NIAH_MULTIKEY_3, 1, 1, 1, ruler.Haystack.NEEDLE),
        (AccuracyTask.NIAH_MULTIVALUE, 4, 1, 4, ruler.Haystack.NOISE),
        (AccuracyTask.NIAH_MULTIQUERY, 4, 4, 4, ruler.Haystack.NOISE),
    ],
)
def test_rulers_samples_have_its_shape(
    name: AccuracyTask, needles: int, asked: int, expected: int, haystack: ruler.Haystack
) -> None:
    task = tasks.task(name)
    sample = task.draw(7, 3)
    assert sample == task.draw(7, 3) and sample != task.draw(7, 4)
    [question] = sample.questions
    assert len(sample.needles) == needles and len(question.expected) == expected
    assert list(sample.depths) == sorted(sample.depths) and all(0 <= d < 1 for d in sample.depths)
    parsed, keys = niah.parse_prompt("".join(sample.needles) + question.text)
    assert len(keys) == asked
    assert sorted(value for key in keys for value in parsed[key]) == sorted(question.expected)
    units = task.units(7)
    if haystack == ruler.Haystack.NOISE:
        assert units == ("\n" + FILLER,) and sample.unit_order is None
    else:
        # A pool of distinct distractors, none with the asked key, in a per-sample order.
        distractors, _ = niah.parse_prompt("".join(units))
        assert len(distractors) == len(units) == ruler.DISTRACTOR_POOL
        assert not set(keys) & set(distractors)
        assert sorted(sample.unit_order or ()) == list(range(ruler.DISTRACTOR_POOL))


def test_a_prompt_is_rulers_text_line_by_line() -> None:
    """Header, filler lines and the needle line joined by newlines, then the question and the answer prefix."""
    tokenizer = LocalTokenizer(Family.BYTE_LEVEL_BPE)
    task = tasks.task(AccuracyTask.NIAH_SINGLE_1)
    needle = ruler.NIAH_SINGLE_1.needle("amber-anchor", "1234567")
    question = niah.Question(SINGLE_QUESTION, ("1234567",))
    sample = niah.TaskSample(needles=(needle,), depths=(0.5,), questions=(question,))

    async def build() -> str:
        shared = await shared_pieces(tokenizer, task)
        line = len(shared.sentences[0])
        fixed = len(shared.header) + len(await tokenizer.tokenize(needle, False))
        fixed += len(await tokenizer.tokenize(SINGLE_QUESTION, False)) + len(shared.prefix) + len(shared.suffix)
        [prompt] = await sized_prompts(tokenizer, shared, sample, fixed + 2 * line)
        return tokenizer.decode(prompt)

    assert asyncio.run(build()) == (
        f"{ruler.NIAH_SINGLE_1.header()}\n{FILLER}\nOne of the special magic numbers for amber-anchor is: "
        f"1234567.\n{FILLER}{SINGLE_QUESTION}"
    )


def test_string_match_all_by_hand() -> None:
    task = tasks.task(AccuracyTask.NIAH_MULTIVALUE)
    expected = ("1234567", "7654321", "1111111", "2222222")
    answer = " 7654321, 1234567 and 9999999."
    assert task.score(answer, expected) == (True, True, False, False)
    assert niah.string_match_all(answer, expected) == 0.5
    # Case-insensitive, as RULER's (a UUID in capitals still counts).
    uuid_value = "94959d75-ff78-4b4a-b3a0-23e74269393e"
    assert tasks.task(AccuracyTask.NIAH_MULTIKEY_3).score(f" {uuid_value.upper()}.", (uuid_value,)) == (True,)


def test_the_simulator_recalls_each_of_a_keys_values() -> None:
    needles = {"amber-anchor": ("1234567", "7654321", "1111111", "2222222"), "calm-dune": ("3333333",)}
    right = answer_needles(needles, ("amber-anchor",), 1000, capability_p=1.0, survival_p=1.0, seed=0)
    assert right == " 1234567, 7654321, 1111111, 2222222."
    wrong = answer_needles(needles, ("amber-anchor",), 1000, capability_p=1.0, survival_p=0.0, seed=0)
    # A lost value is never another of the key's own.
    assert wrong == " 3333333, 3333333, 3333333, 3333333."


def test_mrcr_conversations_have_mrcrs_format() -> None:
    assert [mrcr.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"
    ]  # fmt: skip
    sample = mrcr.draw(4, seed=5, index=2)
    assert sample == mrcr.draw(4, seed=5, index=2) and sample != mrcr.draw(4, seed=5, index=3)
    assert len({turn.ask for turn in sample.needles}) == 1 and len({turn.answer for turn in sample.needles}) == 4
    ask = sample.needles[0].ask
    form_topic = ask.removeprefix("Write a ").removesuffix(".")
    assert sample.final == (
        f"Prepend {sample.prefix} to the {mrcr.ordinal(sample.asked + 1)} (1 indexed) {form_topic}. Do not include "
        "any other text in your response."
    )
    assert sample.expected == sample.prefix + sample.needles[sample.asked].answer
    messages = sample.messages(500)
    assert [m["role"] for m in messages] == ["user", "assistant"] * ((len(messages) - 1) // 2) + ["user"]
    assert messages[-1]["content"] == sample.final
    # The identical asks keep their order; no distractor repeats the ask.
    asked = [messages[i + 1]["content"] for i in range(0, len(messages) - 1, 2) if messages[i]["content"] == ask]
    assert asked == [turn.answer for turn in sample.needles]
    answers = sum(len(m["content"].split(" ")) for m in messages[1:-1:2] if m["content"] not in asked)
    assert answers == 500
    with pytest.raises(ValueError, match="2, 4 or 8"):
        mrcr.draw(3, 0, 0)


def test_mrcr_grade_by_hand() -> None:
    answer = "aYooSG8CQgThe calm tapir rests."
    assert mrcr.grade(answer, answer, "aYooSG8CQg") == 1.0
    assert mrcr.grade("The calm tapir rests.", answer, "aYooSG8CQg") == 0.0  # no prefix, no credit
    # SequenceMatcher on what follows the prefix: "abd" against "abc" matches 2 of 3 characters each: 2*2/6.
    assert mrcr.grade("XYZabd", "XYZabc", "XYZ") == pytest.approx(2 * 2 / 6)
    assert mrcr.grade("XYZabd", "XYZabc", "XYZ") == difflib.SequenceMatcher(None, "abd", "abc").ratio()
    assert niah.strip_thinking("<think>first the 2nd poem</think>\n\nXYZabc") == "XYZabc"
    assert niah.strip_thinking("reasoning without its opening tag</think> XYZabc") == "XYZabc"
    assert niah.strip_thinking("XYZabc") == "XYZabc"
    # A score counts as a right needle with its own probability, the same draw for both sides.
    assert mrcr.right(1.0, answer) and not mrcr.right(0.0, answer)
    assert mrcr.right(0.5, answer) == mrcr.right(0.5, answer)
    drawn = [mrcr.right(0.3, f"answer {i}") for i in range(2000)]
    assert 0.25 < sum(drawn) / len(drawn) < 0.35
    task = tasks.task(AccuracyTask.MRCR, needles=2)
    assert task.score("XYZabc", ("XYZabc",)) == (True,) and task.score("abc", ("XYZabc",)) == (False,)


def test_a_chat_asks_rulers_question_without_the_answer_prefix() -> None:
    question = niah.Question(SINGLE_QUESTION, ("1234567",))
    assert niah.chat_question(question) == (
        "\nWhat is the special magic number for amber-anchor mentioned in the provided text?"
    )
    needle = ruler.NIAH_SINGLE_1.needle("amber-anchor", "1234567")
    sample = niah.TaskSample(needles=(needle,), depths=(0.5,), questions=(question,))
    words = len(FILLER.split()) * 2
    text = niah.chat_text("H.", ["\n" + FILLER], sample, question, words)
    assert text == f"H.\n{FILLER}{needle}\n{FILLER}" + niah.chat_question(question)


def test_the_crd_refuses_mrcr_as_a_completion_and_other_needle_counts() -> None:
    with pytest.raises(ValidationError, match="set promptFormat Chat or Auto"):
        AccuracyGate.model_validate({"task": "mrcr"})
    with pytest.raises(ValidationError, match="must be 2, 4 or 8"):
        AccuracyGate.model_validate({"task": "mrcr", "promptFormat": "Chat", "mrcrNeedles": 3})
    assert AccuracyGate.model_validate({"task": "mrcr", "promptFormat": "Auto"}).mrcr_needles == 2
    assert AccuracyGate().prompt_format == PromptFormat.COMPLETION


@pytest.mark.parametrize("name", [AccuracyTask.MRCR, AccuracyTask.NIAH_SINGLE_1])
async def test_a_chat_is_the_longest_that_fits_and_the_server_counts_it_so(name: AccuracyTask) -> None:
    task = tasks.task(name, needles=4)
    sample = task.draw(1, 1)
    [question] = sample.questions
    async with in_process_simulator() as url, aiohttp.ClientSession() as session:
        client = VllmClient(session, url, MODEL, timeout_s=30)

        def build(words: int) -> list[niah.Message]:
            return task.chat(1, sample, question, words)

        for length in (2500, 6001):
            prompt = await sized_chat(client, build, length)
            words = next(n for n in range(10**6) if build(n) == prompt.messages)
            assert prompt.tokens <= length < len(await client.tokenize_chat(build(words + 1)))
            answer = await client.chat(prompt.messages, 8)
            assert answer.prompt_tokens == prompt.tokens


@pytest.fixture(scope="module")
def h200() -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(
            start_simulator_subprocess([MODEL, *FAST, "--kv-cache-dtype", "fp8", "--gpu", "h200"])
        )


@pytest.fixture(scope="module")
def base_model() -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(start_simulator_subprocess([MODEL, *FAST, "--no-chat-template"]))


@pytest.mark.parametrize("name", list(AccuracyTask))
def test_an_h200_canary_without_two_level_accumulation_fails_at_128k_on_every_task(
    name: AccuracyTask, h200: str, simulators: dict[str, str], tmp_path: Path
) -> None:
    chat = ["--prompt-format", "Chat"] if name == AccuracyTask.MRCR else []
    code, result = run_gate(
        "accuracy", h200, simulators["bf16"], tmp_path, "--length", "131072", "--model", MODEL, "--task", name, *chat
    )
    assert (code, result["verdict"], result["reason"], result["task"]) == (1, "Fail", "RecoveryBelowThreshold", name)
    assert result["recoveryHigh"] <= 0.95 and result["canaryScore"] < result["baselineScore"]


def test_auto_is_chat_with_a_chat_template_and_completion_without(
    base_model: str, simulators: dict[str, str], tmp_path: Path
) -> None:
    bf16 = simulators["bf16"]
    flags = ("--length", "2048", "--model", MODEL, "--prompt-format", "Auto", "--max-samples", "2")
    _, chat = run_gate("accuracy", bf16, bf16, tmp_path, *flags, "--task", "niah_single_1")
    _, completion = run_gate("accuracy", base_model, base_model, tmp_path, *flags, "--task", "niah_single_1")
    assert (chat["promptFormat"], chat["baselineScore"]) == ("Chat", 1.0)
    assert (completion["promptFormat"], completion["baselineScore"]) == ("Completion", 1.0)
    code, refused = run_gate("accuracy", base_model, base_model, tmp_path, *flags, "--task", "mrcr")
    assert (code, refused["verdict"], refused["reason"]) == (2, "Inconclusive", "ChatTemplateMissing")


@pytest.fixture(scope="module")
def shifted() -> Iterator[str]:
    """Two-level FP8 with uncalibrated KV scales: ~2% of needles lost at every length."""
    flags = ["--kv-cache-dtype", "fp8", "--two-level-fix", "--kv-scale-error", "0.30"]
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(start_simulator_subprocess([MODEL, *FAST, *flags]))


def test_a_chat_length_profile_flags_a_shift_at_every_length(
    shifted: str, simulators: dict[str, str], tmp_path: Path
) -> None:
    """Chats are sized per bucket like completions, and the profile reads them alike (RULER's niah_multivalue)."""
    flags = ("--length", "16384", "--model", MODEL, "--task", "niah_multivalue", "--prompt-format", "Chat")
    _, result = run_gate("accuracy", shifted, simulators["bf16"], tmp_path, *flags, "--length-buckets", "4")
    assert (result["promptFormat"], result["task"]) == ("Chat", "niah_multivalue")
    profile = result["profile"]
    assert [bucket["lengthTokens"] for bucket in profile["buckets"]] == [2048, 4096, 8192, 16384]
    assert profile["systematicShift"] is True and "calibrate the KV scales" in result["message"]
