"""`kvpolicy sim`: run a vLLM-like server; flags mirror `vllm serve` plus the simulated hardware and image."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from kvpolicy_dev.sim.config import KV_CACHE_DTYPES, Gpu, SimConfig
from kvpolicy_dev.sim.models import DEFAULT_PROFILE, find_profile
from kvpolicy_dev.sim.server import serve
from kvpolicy_dev.sim.tokenizer import load_tokenizer

log = logging.getLogger("kvpolicy_dev.sim")


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port number (0 lets the system pick a free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0 to 65535)")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpolicy sim",
        description="Serve a simulated vLLM OpenAI-compatible API whose long-context accuracy follows emulated "
        "FP8 accumulation and whose latency follows published fits.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help=f"model name (as `vllm serve`; default {SimConfig.served_model_name}); it picks the simulated model's "
        "profile from a small catalogue (kvpolicy_dev.sim.models)",
    )
    vllm = parser.add_argument_group("vllm serve flags")
    vllm.add_argument("--host", default="127.0.0.1")
    vllm.add_argument("--port", type=tcp_port, default=8000)
    vllm.add_argument("--served-model-name", help="name clients use (default: MODEL)")
    vllm.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    vllm.add_argument(
        "--kv-cache-dtype-skip-layers",
        nargs="+",
        default=[],
        metavar="LAYER",
        help="layers kept in BF16: 'sliding_window' and/or layer indices",
    )
    vllm.add_argument("--attention-backend", help="attention backend name (FLASH_ATTN, FLASHINFER, CUSTOM, ...)")
    vllm.add_argument("--max-model-len", type=int, default=SimConfig.max_model_len)
    vllm.add_argument(
        "--tokenizer",
        type=Path,
        help="a Hugging Face model directory or tokenizer.json to tokenize with (default: a built-in word tokenizer)",
    )
    # Multi-host vLLM's flags (a LeaderWorkerSet's leader and headless workers): accepted as vLLM accepts them, and
    # otherwise ignored: one simulated process stands for the whole group.
    distributed = parser.add_argument_group("vllm serve distributed flags (accepted, not simulated)")
    for flags in (
        ("--tensor-parallel-size", "-tp"),
        ("--pipeline-parallel-size", "-pp"),
        ("--data-parallel-size", "-dp"),
        ("--nnodes",),
        ("--node-rank",),
    ):
        distributed.add_argument(*flags, type=int, default=1 if flags[0] != "--node-rank" else 0)
    distributed.add_argument("--master-addr")
    distributed.add_argument("--master-port", type=int)
    distributed.add_argument("--headless", action="store_true")
    sim = parser.add_argument_group("simulator flags")
    sim.add_argument("--gpu", choices=[gpu.value for gpu in Gpu], default=Gpu.H100.value)
    sim.add_argument("--two-level-fix", action="store_true", help="the image carries two-level FP8 accumulation")
    sim.add_argument(
        "--fast-head-dim-256", action="store_true", help="the image declares the fast head_dim-256 two-level path"
    )
    shape = parser.add_argument_group("model shape (default: the model's catalogue profile)")
    shape.add_argument("--head-dim", type=int)
    shape.add_argument("--num-layers", type=int)
    shape.add_argument("--sliding-window-layers", type=int, metavar="N", help="how many layers use a window")
    shape.add_argument("--sliding-window-tokens", type=int, metavar="W")
    sim.add_argument(
        "--kv-scale-error",
        type=float,
        default=0.0,
        metavar="E",
        help="relative attention error uncalibrated FP8 KV scales add at every length (0.30: about 2%% of needles "
        "lost in every length bucket)",
    )
    sim.add_argument("--time-scale", type=float, default=1.0, help="multiply every sleep (1.0 = real time)")
    sim.add_argument("--latency-multiplier", type=float, default=1.0, help="scale all simulated latencies")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="serve a model without a chat template (a base model): chat requests are refused",
    )
    return parser


def _given_or(value: int | None, profile_value: int) -> int:
    return profile_value if value is None else value


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The configuration the flags describe; shape flags not given come from the model's catalogue profile."""
    served_model_name = args.served_model_name or args.model or SimConfig.served_model_name
    profile = find_profile(args.model, served_model_name) or DEFAULT_PROFILE
    load_tokenizer(args.tokenizer)  # refuse a missing or malformed tokenizer before serving
    try:
        return SimConfig(
            served_model_name=served_model_name,
            kv_cache_dtype=args.kv_cache_dtype,
            skip_layers=tuple(args.kv_cache_dtype_skip_layers),
            attention_backend=args.attention_backend,
            max_model_len=args.max_model_len,
            gpu=Gpu(args.gpu),
            two_level_fix=args.two_level_fix,
            fast_head_dim_256=args.fast_head_dim_256,
            kv_scale_error=args.kv_scale_error,
            head_dim=_given_or(args.head_dim, profile.head_dim),
            num_layers=_given_or(args.num_layers, profile.num_layers),
            sliding_window_layers=_given_or(args.sliding_window_layers, profile.sliding_window_layers),
            sliding_window_tokens=_given_or(args.sliding_window_tokens, profile.sliding_window_tokens),
            profile=profile,
            time_scale=args.time_scale,
            latency_multiplier=args.latency_multiplier,
            seed=args.seed,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
        )
    except ValueError as error:
        raise ValueError(f"{error} (shape flags not given come from model profile {profile.name})") from None


def describe(config: SimConfig) -> str:
    """The start-up log line: what is simulated, with which model profile and shape."""
    sliding = (
        f", {config.sliding_window_layers} sliding-window layers of {config.sliding_window_tokens} tokens"
        if config.sliding_window_layers
        else ""
    )
    return (
        f"simulating {config.served_model_name} with model profile {config.profile.name} (head_dim {config.head_dim}, "
        f"{config.num_layers} layers{sliding}{', MLA' if config.profile.mla else ''}) on {config.gpu.value}: "
        f"kv-cache-dtype {config.kv_cache_dtype}, two-level fix {config.two_level_fix}, "
        f"attention backend {config.attention_backend or 'default'}"
    )


async def _run(config: SimConfig, host: str, port: int) -> None:
    async with serve(config, host, port) as url:
        log.info("%s; serving at %s", describe(config), url)
        await asyncio.Event().wait()


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        asyncio.run(_run(config, args.host, args.port))
    except KeyboardInterrupt:
        pass
    except OSError as error:
        print(f"kvpolicy sim: cannot serve on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1
    return 0
