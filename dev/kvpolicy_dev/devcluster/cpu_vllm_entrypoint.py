"""A vLLM image's entrypoint on this CPU: `python -m kvpolicy_dev.devcluster.cpu_vllm_entrypoint --model-dir DIR
--host H --port P [--entrypoint-drops FLAG]... [--entrypoint-adds WORD]... -- SERVE_ARGS` serves what
`vllm serve SERVE_ARGS` would, in this process:

1. the image's quirks (tests only: an entrypoint that loses or rewrites flags) change SERVE_ARGS;
2. vLLM's own parser checks SERVE_ARGS: an argument it refuses ends the process with vLLM's message and status 2;
3. flags that only choose a GPU kernel are checked with vLLM's own validator, then left out, with a log line; so
   are multi-host flags (tensor/pipeline/data parallel sizes, --nnodes, --node-rank, --master-addr): the leader's one
   process serves the whole group, and a `--headless` worker, which serves no API, only waits once they are checked;
4. the model (SERVE_ARGS' positional) becomes --model DIR, served under the name the container asked for, and the
   CPU runtime arguments (eager mode, a KV cache sized for --max-model-len and the model, random weights when DIR
   has none) are added;
5. vLLM's OpenAI-compatible server runs with the result.

Every step is logged to stderr (the pod's log), starting with the arguments exactly as the container gave them.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvpolicy_dev.devcluster.cpu_vllm import DISTRIBUTED_FLAGS, GPU_KERNEL_FLAGS, ServedModel
from kvpolicy_dev.devcluster.runners import EntrypointQuirk, drop_flags

SITE_DIR = Path(__file__).parent / "vllm_site"
PREFIX = "kvpolicy cpu-vllm:"
EXIT_REFUSED = 2
# Set for the server and every process it starts: one OpenMP thread per server, no pinning (several servers share
# two cores), no network (nothing may be downloaded), and the explicit KV cache size instead of the legacy
# VLLM_CPU_KVCACHE_SPACE, which would override it in whole GiB.
SERVER_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServeRequest:
    """What `vllm serve` was asked, as vLLM's parser read it."""

    model: str
    served_model_name: list[str] | None
    max_model_len: int | None
    gpu_kernel_values: dict[str, str]  # flag -> value given
    headless: bool = False  # a multi-host worker: no API of its own


def parse_with_vllm(serve_args: Sequence[str]) -> ServeRequest:
    """Parse like `vllm serve` does; an argument vLLM refuses exits with its usage message and status 2."""
    from vllm.config.attention import AttentionConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))  # type: ignore[no-untyped-call]
    namespace = parser.parse_args(list(serve_args))
    model = namespace.model_tag
    if model is None:
        parser.error("the model is missing: `vllm serve MODEL ...`")
    kernels: dict[str, str] = {}
    if namespace.attention_backend is not None:
        value = str(namespace.attention_backend)
        try:  # what vLLM's engine config does with the string: "auto" or an AttentionBackendEnum name
            AttentionConfig.validate_backend_before(value)
        except (KeyError, ValueError):  # AttentionBackendEnum's lookup raises ValueError for an unknown name
            parser.error(f"argument --attention-backend: {value!r} is not an attention backend vLLM knows")
        kernels["--attention-backend"] = value
    return ServeRequest(model, namespace.served_model_name, namespace.max_model_len, kernels, namespace.headless)


def cpu_arguments(serve_args: Sequence[str], request: ServeRequest, model_dir: Path, host: str, port: int) -> list[str]:
    """SERVE_ARGS for this CPU: the model directory in place of the model, GPU-kernel flags out, CPU runtime args in."""
    rest = list(serve_args)
    if rest and rest[0] == request.model:
        rest = rest[1:]
    rest = drop_flags(rest, (*GPU_KERNEL_FLAGS, *DISTRIBUTED_FLAGS))
    names = [] if request.served_model_name else ["--served-model-name", request.model]
    model = ServedModel.read(model_dir)
    kv_cache = [
        "--kv-cache-memory-bytes",
        str(model.kv_cache_bytes(request.max_model_len or model.max_position_embeddings)),
    ]
    runtime = model.runtime_args()
    return ["--model", str(model_dir), *rest, *names, *runtime, *kv_cache, "--host", host, "--port", str(port)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvpolicy_dev.devcluster.cpu_vllm_entrypoint", description=__doc__)
    parser.add_argument(
        "--model-dir",
        type=Path,
        required=True,
        help="a model directory (kvpolicy_dev.models, cpu_vllm.write_model_dir)",
    )
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--entrypoint-drops", action="append", default=[], metavar="FLAG")
    parser.add_argument("--entrypoint-adds", action="append", default=[], metavar="WORD")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then the `vllm serve` arguments")
    return parser


def main(argv: Sequence[str]) -> int:
    options = build_parser().parse_args(argv)
    serve_args = options.serve_args[1:] if options.serve_args[:1] == ["--"] else options.serve_args
    say(f"the container runs: vllm serve {shlex.join(serve_args)}")
    quirk = EntrypointQuirk(tuple(options.entrypoint_drops), tuple(options.entrypoint_adds))
    if quirk != EntrypointQuirk():
        serve_args = quirk.apply(serve_args)
        say(f"this image's entrypoint drops {list(quirk.drop)} and adds {list(quirk.add)}: vLLM gets "
            f"{shlex.join(serve_args)}")  # fmt: skip
    if not options.model_dir.joinpath("config.json").is_file():
        say(f"{options.model_dir} has no config.json: write it with kvpolicy_dev.devcluster.cpu_vllm.write_model_dir")
        return EXIT_REFUSED
    os.environ.update(SERVER_ENVIRONMENT)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE_DIR), os.environ.get("PYTHONPATH")]))
    import torch

    torch.cpu._init_amx()  # this process too (see vllm_site/sitecustomize.py)
    request = parse_with_vllm(serve_args)
    for flag, value in request.gpu_kernel_values.items():
        say(f"{flag} {value}: accepted by vLLM's parser and validator; left out on CPU, where vLLM picks its kernel")
    distributed = [token for token in serve_args if token.split("=", 1)[0] in DISTRIBUTED_FLAGS]
    if distributed:
        say(f"{' '.join(distributed)}: accepted by vLLM's parser; left out on CPU, where one process serves the group")
    if request.headless:
        say("a headless node serves no API: waiting (the group's leader serves it)")
        _answer_liveness(options.host, options.port)
    arguments = cpu_arguments(serve_args, request, options.model_dir, options.host, options.port)
    say(f"vLLM on CPU runs: {shlex.join(arguments)}")
    _fork_the_engine_core()
    sys.argv = ["vllm serve", *arguments]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
    return 0


def _fork_the_engine_core() -> None:
    """Start vLLM's engine core process by fork, not spawn. vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD to
    spawn in its config check, so the engine core imports torch and vLLM all over again: about half of a server's
    start-up on two cores (13 of 30 s). Here the API server has imported them, CUDA is never initialised, and the
    AMX permission (see vllm_site/sitecustomize.py) is inherited, so the fork serves the same engine without the
    second import (vLLM's own default where nothing forces spawn). Only the start method changes: the arguments, the
    config and the serving path are vLLM's."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]  # a classmethod's function

    def check_and_update_config(cls: type[CpuPlatform], vllm_config: object) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment, method-assign]


class _HealthOnly(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """The kubelet polls often: no line per poll in the pod's log."""


def _answer_liveness(host: str, port: int) -> None:
    """Wait forever, answering GET /health. A real kubelet marks a worker pod without a readinessProbe (vLLM's LWS
    examples give workers none) ready once it runs; the dev cluster's kubelet marks a pod ready when it answers
    /health, so the headless worker answers that and nothing else, and its group counts as ready like a real one."""
    ThreadingHTTPServer((host, port), _HealthOnly).serve_forever()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
