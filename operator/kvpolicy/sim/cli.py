"""`kvpolicy sim`: run a vLLM-like server; flags mirror `vllm serve` plus the simulated hardware and image."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvpolicy.sim.config import KV_CACHE_DTYPES, Gpu, SimConfig
from kvpolicy.sim.server import serve

log = logging.getLogger("kvpolicy.sim")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpolicy sim",
        description="Serve a simulated vLLM OpenAI-compatible API whose long-context accuracy follows emulated "
        "FP8 accumulation and whose latency follows published fits.",
    )
    parser.add_argument("model", nargs="?", default=SimConfig.served_model_name, help="model name (as `vllm serve`)")
    vllm = parser.add_argument_group("vllm serve flags")
    vllm.add_argument("--host", default="127.0.0.1")
    vllm.add_argument("--port", type=int, default=8000)
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
    sim = parser.add_argument_group("simulator flags")
    sim.add_argument("--gpu", choices=[gpu.value for gpu in Gpu], default=Gpu.H100.value)
    sim.add_argument("--two-level-fix", action="store_true", help="the image carries two-level FP8 accumulation")
    sim.add_argument(
        "--fast-head-dim-256", action="store_true", help="the image declares the fast head_dim-256 two-level path"
    )
    sim.add_argument("--head-dim", type=int, default=SimConfig.head_dim)
    sim.add_argument("--num-layers", type=int, default=SimConfig.num_layers)
    sim.add_argument("--sliding-window-layers", type=int, default=0, metavar="N", help="how many layers use a window")
    sim.add_argument("--sliding-window-tokens", type=int, default=SimConfig.sliding_window_tokens, metavar="W")
    sim.add_argument("--time-scale", type=float, default=1.0, help="multiply every sleep (1.0 = real time)")
    sim.add_argument("--latency-multiplier", type=float, default=1.0, help="scale all simulated latencies")
    sim.add_argument("--seed", type=int, default=0)
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        served_model_name=args.served_model_name or args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        skip_layers=tuple(args.kv_cache_dtype_skip_layers),
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        gpu=Gpu(args.gpu),
        two_level_fix=args.two_level_fix,
        fast_head_dim_256=args.fast_head_dim_256,
        head_dim=args.head_dim,
        num_layers=args.num_layers,
        sliding_window_layers=args.sliding_window_layers,
        sliding_window_tokens=args.sliding_window_tokens,
        time_scale=args.time_scale,
        latency_multiplier=args.latency_multiplier,
        seed=args.seed,
    )


async def _run(config: SimConfig, host: str, port: int) -> None:
    async with serve(config, host, port) as url:
        log.info(
            "simulating %s on %s: kv-cache-dtype %s, two-level fix %s, attention backend %s; serving at %s",
            config.served_model_name,
            config.gpu.value,
            config.kv_cache_dtype,
            config.two_level_fix,
            config.attention_backend or "default",
            url,
        )
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
