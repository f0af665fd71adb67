"""What stands in for a container: which local process (if any) a pod's container runs, and GPU node labels."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_SERVER_PORT = 8000


@dataclass(frozen=True)
class GpuModel:
    family: str  # nvidia.com/gpu.family as GPU Feature Discovery reports it
    compute_major: int
    compute_minor: int
    simulator_name: str  # `kvpolicy sim --gpu` value


GPU_MODELS: dict[str, GpuModel] = {
    "NVIDIA-H100-80GB-HBM3": GpuModel("hopper", 9, 0, "h100"),
    "NVIDIA-H200": GpuModel("hopper", 9, 0, "h200"),
    "NVIDIA-B200": GpuModel("blackwell", 10, 0, "b200"),
    "NVIDIA-A100-SXM4-80GB": GpuModel("ampere", 8, 0, "a100"),
    "NVIDIA-L40S": GpuModel("ada-lovelace", 8, 9, "l40s"),
}


def gpu_model(product: str) -> GpuModel:
    try:
        return GPU_MODELS[product]
    except KeyError:
        raise ValueError(f"unknown GPU product {product!r}; known: {', '.join(sorted(GPU_MODELS))}") from None


class ContainerRunner(Protocol):
    """Decides the process standing in for a long-running container; None means no process (ready at once)."""

    def argv(self, container: Mapping[str, Any], node_labels: Mapping[str, str], pod_ip: str) -> list[str] | None: ...


class NoProcessRunner:
    """Every container is ready at once and runs nothing."""

    def argv(self, container: Mapping[str, Any], node_labels: Mapping[str, str], pod_ip: str) -> list[str] | None:
        return None


def container_port(container: Mapping[str, Any]) -> int:
    ports = container.get("ports") or []
    return int(ports[0]["containerPort"]) if ports else DEFAULT_SERVER_PORT


def vllm_serve_args(container: Mapping[str, Any]) -> list[str] | None:
    """The arguments after `vllm serve` (model first), or None when the container does not run vLLM's server."""
    command = [str(part) for part in container.get("command") or []]
    args = [str(part) for part in container.get("args") or []]
    if command[:2] == ["vllm", "serve"]:
        return command[2:] + args
    if command in ([], ["vllm"]) and args[:1] == ["serve"]:
        return args[1:]
    return None


def drop_flags(tokens: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`tokens` without `flags` (`--flag value...` and `--flag=value` forms; a flag's values run to the next flag)."""
    out: list[str] = []
    dropping = False
    for token in tokens:
        if token.startswith("-"):
            if token.split("=", 1)[0] in flags:
                dropping = "=" not in token  # only the spaced form has values after it
                continue
            dropping = False
        if not dropping:
            out.append(token)
    return out


@dataclass(frozen=True)
class EntrypointQuirk:
    """How an image's entrypoint changes the `vllm serve` arguments before vLLM sees them (a wrapper script that
    loses or rewrites flags): `drop` removes those flags with their values, then `add` is appended. Tests use it to
    start a canary that does not serve what its pod spec says."""

    drop: tuple[str, ...] = ()
    add: tuple[str, ...] = ()

    def apply(self, serve_args: Sequence[str]) -> list[str]:
        return [*drop_flags(serve_args, self.drop), *self.add]


@dataclass(frozen=True)
class SimulatorRunner:
    """Runs `kvpolicy sim` for vLLM containers, on the GPU model of the node the pod landed on."""

    time_scale: float = 0.001
    # Images (exact `image` strings) whose vLLM build carries the two-level FP8 accumulation fix / fast head-dim 256.
    two_level_fix_images: frozenset[str] = frozenset()
    fast_head_dim_256_images: frozenset[str] = frozenset()
    seed: int = 0
    # image -> how its entrypoint changes the arguments (see EntrypointQuirk)
    quirks: Mapping[str, EntrypointQuirk] = field(default_factory=dict)

    def argv(self, container: Mapping[str, Any], node_labels: Mapping[str, str], pod_ip: str) -> list[str] | None:
        serve_args = vllm_serve_args(container)
        if serve_args is None:
            return None
        quirk = self.quirks.get(str(container.get("image", "")))
        if quirk is not None:
            serve_args = quirk.apply(serve_args)
        product = node_labels.get(GPU_PRODUCT_LABEL)
        if product is None:
            raise ValueError(f"a vLLM container needs a GPU node; the node has no {GPU_PRODUCT_LABEL} label")
        argv = [sys.executable, "-m", "kvpolicy", "sim", *serve_args]
        argv += ["--host", pod_ip, "--port", str(container_port(container)), "--gpu", gpu_model(product).simulator_name]
        image = container.get("image", "")
        if image in self.two_level_fix_images:
            argv.append("--two-level-fix")
        if image in self.fast_head_dim_256_images:
            argv.append("--fast-head-dim-256")
        return [*argv, "--time-scale", repr(self.time_scale), "--seed", str(self.seed)]
