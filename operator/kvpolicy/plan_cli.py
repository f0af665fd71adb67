"""`kvpolicy plan`: a dry run of the planner for KVPolicy manifests on a named GPU or on given node labels."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvpolicy.api.v1alpha1 import KIND, GpuFacts, KVPolicySpec, Plan
from kvpolicy.gpu import KNOWN_PRODUCTS, gpu_facts
from kvpolicy.planner import plan


class InputError(Exception):
    """Bad input: the message says what to fix."""


def format_validation_error(error: ValidationError, prefix: str = "spec") -> str:
    lines = []
    for item in error.errors():
        path = ".".join([prefix, *(str(part) for part in item["loc"])])
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {path}: {message}")
    return "\n".join(lines)


def load_policies(text: str, source: str) -> list[tuple[str, KVPolicySpec]]:
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise InputError(f"{source}: not valid YAML: {err}") from err
    policies = []
    for index, document in enumerate(documents):
        if not isinstance(document, Mapping) or document.get("kind") != KIND:
            raise InputError(f"{source}: document {index + 1} is not a {KIND} (kind: {KIND} expected)")
        name = str((document.get("metadata") or {}).get("name", f"document-{index + 1}"))
        try:
            spec = KVPolicySpec.model_validate(document.get("spec") or {})
        except ValidationError as err:
            raise InputError(f"{source}: KVPolicy {name!r} is invalid:\n{format_validation_error(err)}") from err
        policies.append((name, spec))
    if not policies:
        raise InputError(f"{source}: no {KIND} found")
    return policies


def node_labels_from_args(gpu: str | None, labels_file: str | None) -> list[dict[str, str]]:
    if labels_file:
        data = yaml.safe_load(Path(labels_file).read_text(encoding="utf-8"))
        # One label map, or a list of them (one per node).
        nodes = data if isinstance(data, list) else [data]
        if not all(isinstance(n, Mapping) for n in nodes):
            raise InputError(f"{labels_file}: expected a label map or a list of label maps")
        return [{str(k): str(v) for k, v in n.items()} for n in nodes]
    assert gpu is not None
    key = gpu.upper().removeprefix("NVIDIA-")
    if key not in KNOWN_PRODUCTS:
        raise InputError(f"unknown --gpu {gpu!r}: choose one of {', '.join(KNOWN_PRODUCTS)} or pass --node-labels")
    return [dict(KNOWN_PRODUCTS[key])]


def render_text(name: str, gpu: GpuFacts, result: Plan) -> str:
    lines = [
        f"KVPolicy {name}",
        f"  GPU:      {gpu.generation.value} — {gpu.message}",
        f"  KV cache: {result.kv_cache_dtype.value}",
    ]
    if result.is_fp8:
        lines += [
            f"  image:    {result.image or '(target image)'}",
            f"  args:     {' '.join(result.extra_args)}",
            f"  gates:    {', '.join(result.gates) or 'none'}",
        ]
    lines.append("  reasons:")
    width = max(len(r.code) for r in result.reasons)
    for reason in result.reasons:
        marker = "!" if reason.severity.value == "Warning" else "-"
        lines.append(f"    {marker} {reason.code:<{width}}  {reason.message}")
    return "\n".join(lines)


def _render(items: Iterable[tuple[str, GpuFacts, Plan]], output: str) -> str:
    rows = list(items)
    if output == "text":
        return "\n\n".join(render_text(*row) for row in rows) + "\n"
    data: list[dict[str, Any]] = [
        {"name": name, "gpu": gpu.to_k8s(), "plan": result.to_k8s()} for name, gpu, result in rows
    ]
    if output == "json":
        return json.dumps(data if len(data) > 1 else data[0], indent=2) + "\n"
    return yaml.safe_dump_all(data, sort_keys=False)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpolicy plan",
        description="Show what the operator would plan for a KVPolicy on a GPU (a dry run; nothing is changed).",
    )
    parser.add_argument("-f", "--filename", required=True, help="KVPolicy manifest (YAML, may hold several); - = stdin")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", help=f"GPU product: {', '.join(KNOWN_PRODUCTS)}")
    where.add_argument("--node-labels", help="YAML file: a node's labels, or a list of label maps (one per node)")
    parser.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text")
    args = parser.parse_args(argv)
    try:
        if args.filename == "-":
            text, source = sys.stdin.read(), "<stdin>"
        else:
            try:
                text, source = Path(args.filename).read_text(encoding="utf-8"), args.filename
            except OSError as err:
                raise InputError(f"cannot read {args.filename}: {err.strerror}") from err
        policies = load_policies(text, source)
        facts = gpu_facts(node_labels_from_args(args.gpu, args.node_labels))
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(_render(((name, facts, plan(spec, facts)) for name, spec in policies), args.output))
    return 0
