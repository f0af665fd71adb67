"""`kvpolicy plan`: a dry run of the planner for KVPolicy manifests on a named GPU or on given node labels.

Manifests are validated by the same models the CRD is generated from (`KVPolicy`: apiVersion, kind, metadata.name,
the spec's strict types and every CEL rule), so `plan` refuses what the API server would refuse.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvpolicy.api.exit_codes import EXIT_OK, EXIT_USAGE, UsageParser
from kvpolicy.api.v1alpha1 import KIND, GpuFacts, ImagesSpec, KVPolicy, KVPolicySpec, Plan
from kvpolicy.planning.gpu import PRODUCTS, gpu_facts, product_labels
from kvpolicy.planning.planner import plan

STDIN = "-"
# Kinds `kubectl get -o yaml` wraps several objects in.
LIST_KINDS = ("List", f"{KIND}List", "NodeList")
# Error types whose message already says everything (the rules name their values themselves).
_NO_INPUT_SHOWN = {"missing", "extra_forbidden", "value_error", "model_type", "dict_type"}


class InputError(Exception):
    """Bad input: the message says what to fix."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def format_validation_error(error: ValidationError, prefix: str = "spec") -> str:
    lines = []
    for item in error.errors():
        path = ".".join([part for part in [prefix, *(str(part) for part in item["loc"])] if part])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] not in _NO_INPUT_SHOWN:
            message += f" (got {_shown(item['input'])})"
        lines.append(f"  {path}: {message}")
    return "\n".join(lines)


def read_input(path: str, what: str) -> tuple[str, str]:
    """(text, name to show) of a file, or of stdin for `-`."""
    if path == STDIN:
        return sys.stdin.read(), "<stdin>"
    try:
        return Path(path).read_text(encoding="utf-8"), path
    except OSError as err:
        raise InputError(f"cannot read {what} {path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise InputError(f"cannot read {what} {path}: not UTF-8 text ({err.reason})") from err


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML as the API server reads it: a key given twice in one mapping is an error, not "the last one wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found the key {key!r} twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _documents(text: str, source: str) -> list[Any]:
    """The YAML documents of `text`, with the items of `kind: List` documents in their place."""
    try:
        documents = [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d is not None]
    except yaml.YAMLError as err:
        raise InputError(f"{source}: not valid YAML: {err}") from err
    flattened: list[Any] = []
    for document in documents:
        if isinstance(document, Mapping) and document.get("kind") in LIST_KINDS:
            items = document.get("items") or []
            if not isinstance(items, list):
                raise InputError(f"{source}: a {document.get('kind')} whose items are not a list")
            flattened.extend(items)
        else:
            flattened.append(document)
    return flattened


def load_policies(text: str, source: str) -> list[tuple[str, KVPolicySpec]]:
    """Every KVPolicy in the stream; other Kubernetes objects (a `kustomize build` or `helm template` output) are
    passed over, anything that is not an object at all is an error."""
    policies = []
    passed_over: list[str] = []
    for index, document in enumerate(_documents(text, source)):
        if not isinstance(document, Mapping):
            raise InputError(f"{source}: document {index + 1} is a {type(document).__name__}, not a {KIND}")
        if document.get("kind") != KIND:
            passed_over.append(f"document {index + 1} is not a {KIND} (kind: {document.get('kind')!r})")
            continue
        metadata = document.get("metadata")
        name = str(metadata.get("name", f"document-{index + 1}")) if isinstance(metadata, Mapping) else "?"
        try:
            policy = KVPolicy.model_validate(document)
        except ValidationError as err:
            details = format_validation_error(err, prefix="")
            raise InputError(
                f"{source}: KVPolicy {name!r} is invalid (the API server would refuse it):\n{details}"
            ) from err
        policies.append((name, policy.spec))
    if not policies:
        raise InputError(f"{source}: no {KIND} found" + (f" ({'; '.join(passed_over)})" if passed_over else ""))
    return policies


def _node_labels(document: Any, source: str, index: int) -> dict[str, str]:
    """One node's labels from a label map or a Node object (`kubectl get node NAME -o yaml`)."""
    where = f"{source}: document {index + 1}"
    if not isinstance(document, Mapping):
        raise InputError(f"{where} is a {type(document).__name__}: expected a label map, a Node or a list of them")
    if "kind" in document and "apiVersion" in document:
        if document["kind"] != "Node":
            raise InputError(f"{where} is a {document['kind']}: expected a Node (`kubectl get node NAME -o yaml`)")
        labels = (document.get("metadata") or {}).get("labels") or {}
    else:
        labels = document
    if not isinstance(labels, Mapping) or any(isinstance(v, Mapping | list) for v in labels.values()):
        raise InputError(f"{where}: labels must map names to values, such as nvidia.com/gpu.product: NVIDIA-H100")
    return {str(key): str(value) for key, value in labels.items()}


def load_node_labels(text: str, source: str) -> list[dict[str, str]]:
    """Labels of each node: a label map, a list of label maps, Node objects, or a List/NodeList of Nodes."""
    documents = _documents(text, source)
    nodes = [node for document in documents for node in (document if isinstance(document, list) else [document])]
    if not nodes:
        raise InputError(f"{source}: no node labels found")
    return [_node_labels(node, source, index) for index, node in enumerate(nodes)]


def with_vllm_version(spec: KVPolicySpec, version: str) -> KVPolicySpec:
    """The spec with images.vllmVersion set, validated as the API server would validate it."""
    images = spec.images.model_dump(by_alias=True, exclude_unset=True) | {"vllmVersion": version}
    try:
        return spec.model_copy(update={"images": ImagesSpec.model_validate(images)})
    except ValidationError as err:
        raise InputError(f"--vllm-version {version!r}: not a vLLM version such as 0.32.0") from err


def gpu_labels(name: str) -> dict[str, str]:
    """Labels a node of the GPU named `name` carries: a short name (H100, L4, RTX-4090) or a GFD product string."""
    labels = product_labels(name)
    if labels is None:
        raise InputError(
            f"unknown --gpu {name!r}: choose one of {', '.join(p.name for p in PRODUCTS)}, give a GPU Feature "
            "Discovery product string (e.g. NVIDIA-H100-80GB-HBM3), or pass --node-labels"
        )
    return labels


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


def _parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="kvpolicy plan",
        description="Show what the operator would plan for a KVPolicy on a GPU (a dry run; nothing is changed). "
        "The manifest is validated as the API server validates it.",
    )
    parser.add_argument("-f", "--filename", required=True, help="KVPolicy manifest (YAML, may hold several); - = stdin")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--gpu",
        metavar="GPU",
        help=f"a GPU product: {', '.join(p.name for p in PRODUCTS)}, or a GPU Feature Discovery product string",
    )
    where.add_argument(
        "--node-labels",
        metavar="FILE",
        help="YAML: a node's labels, a list of label maps, or `kubectl get node(s) -o yaml` output; - = stdin",
    )
    parser.add_argument(
        "--vllm-version",
        metavar="VERSION",
        help="the vLLM version the image runs (e.g. 0.32.0), in place of each manifest's spec.images.vllmVersion",
    )
    parser.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.filename == STDIN and args.node_labels == STDIN:
            raise InputError("-f and --node-labels cannot both read stdin: give one of them a file")
        policies = load_policies(*read_input(args.filename, "KVPolicy manifest"))
        if args.vllm_version is not None:
            policies = [(name, with_vllm_version(spec, args.vllm_version)) for name, spec in policies]
        if args.node_labels is not None:
            nodes = load_node_labels(*read_input(args.node_labels, "node labels"))
        else:
            nodes = [gpu_labels(args.gpu)]
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    facts = gpu_facts(nodes)
    sys.stdout.write(_render(((name, facts, plan(spec, facts)) for name, spec in policies), args.output))
    return EXIT_OK
