"""What real vLLM 0.32 exposes for chat prompts, on a real instruct model with a chat template (SmolLM2-135M-Instruct's
ChatML), pinned so the gate's chat mode and the simulator follow it rather than a guess (issue 22, promptFormat):

- /v1/models says nothing about a chat template (and /tokenizer_info is off unless the server is started with
  --enable-tokenizer-info-endpoint), so whether a served model has one is learnt by asking /tokenize for `messages`;
- /tokenize with `messages` and `add_generation_prompt` counts exactly the prompt tokens that /v1/chat/completions then
  reports in usage.prompt_tokens for the same messages, so a chat prompt can be sized exactly before it is sent;
- `chat_template_kwargs: {enable_thinking: false}` is accepted by a template that does not use it.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmServer
from kvpolicy_dev.sim import start_simulator_subprocess
from realmodel_helpers import SERVED_MODEL, run_accuracy_gate

pytestmark = [pytest.mark.realvllm, pytest.mark.realmodel]

MESSAGES = [
    {"role": "user", "content": "Write a poem about tapirs."},
    {"role": "assistant", "content": "Tapirs roam the forest floor,\nsnouts that sniff forevermore."},
    {"role": "user", "content": "Prepend aYooSG8CQg to the 1st (1 indexed) poem about tapirs. Do not include any "
     "other text in your response."},
]  # fmt: skip


def _call(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def test_chat_prompts_are_sized_by_tokenize_with_messages(real_model_baseline: RealVllmServer) -> None:
    url = real_model_baseline.url
    [card] = _call(url, "/v1/models")["data"]
    assert not any("template" in key for key in card), card
    counted = _call(url, "/tokenize", {"model": SERVED_MODEL, "messages": MESSAGES, "add_generation_prompt": True})
    plain = _call(url, "/tokenize", {"model": SERVED_MODEL, "messages": MESSAGES, "add_generation_prompt": False})
    # ChatML's generation prompt, "<|im_start|>assistant\n", is what add_generation_prompt adds.
    assert counted["count"] > plain["count"] and counted["tokens"][: plain["count"]] == plain["tokens"]
    chat = _call(
        url,
        "/v1/chat/completions",
        {
            "model": SERVED_MODEL,
            "messages": MESSAGES,
            "max_tokens": 24,
            "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert chat["usage"]["prompt_tokens"] == counted["count"], (chat["usage"], counted["count"])
    assert isinstance(chat["choices"][0]["message"]["content"], str)


def test_the_gate_in_chat_mode_on_the_real_model(real_model_baseline: RealVllmServer) -> None:
    """`--prompt-format Auto` finds SmolLM2's chat template and asks niah_single_1 as a chat: the baseline finds the
    needle. mrcr as a chat ends by the gate's rules; this 135M model never starts its answer with MRCR's random
    prefix (measured 2026-12-02 at 300 to 2,000 tokens, BENCHMARKS.md), so MRCR's grade gives it 0 and the gate says
    BaselineTooWeak rather than judging a canary on it."""
    baseline = real_model_baseline.url
    fixed = ("--min-samples", "3", "--max-samples", "3")
    niah = run_accuracy_gate("niah_single_1 chat A/A", baseline, baseline, 2000, "--task", "niah_single_1",
                             "--prompt-format", "Auto", *fixed).report  # fmt: skip
    assert (niah["promptFormat"], niah["samples"]) == ("Chat", 3), niah
    assert niah["baselineScore"] > 0, niah
    mrcr = run_accuracy_gate("mrcr chat A/A", baseline, baseline, 1000, "--task", "mrcr", "--prompt-format", "Chat",
                             *fixed).report  # fmt: skip
    assert (mrcr["task"], mrcr["promptFormat"]) == ("mrcr", "Chat"), mrcr
    if mrcr["baselineScore"] == 0:
        assert (mrcr["verdict"], mrcr["reason"]) == ("Inconclusive", "BaselineTooWeak"), mrcr
    else:
        assert mrcr["verdict"] in ("Pass", "Fail", "Inconclusive"), mrcr


def _fields(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's field names, level by level (the parts the gate and the simulator's callers read)."""
    [choice] = body["choices"]
    return {"body": set(body), "choice": set(choice), "message": set(choice["message"]), "usage": set(body["usage"])}


def test_the_simulator_answers_a_chat_with_real_vllms_fields(real_model_baseline: RealVllmServer) -> None:
    """The simulator's /tokenize with messages and /v1/chat/completions carry the fields real vLLM 0.32's do."""
    request = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0}
    counting = {"model": SERVED_MODEL, "messages": MESSAGES, "add_generation_prompt": True}
    with start_simulator_subprocess([SERVED_MODEL, "--time-scale", "0", "--max-model-len", "8192"]) as sim:
        real_url = real_model_baseline.url
        real, simulated = (_call(url, "/v1/chat/completions", request) for url in (real_url, sim))
        assert _fields(simulated) == _fields(real), (real, simulated)
        assert simulated["object"] == real["object"] == "chat.completion"
        real_count, sim_count = (_call(url, "/tokenize", counting) for url in (real_url, sim))
        assert set(sim_count) == set(real_count), (real_count, sim_count)
