"""`kvpolicy plan` on bad and unusual input: a message naming what to fix and exit code 64 (EXIT_USAGE, as every
kvpolicy command), never a traceback;
stdin, `kubectl get node -o yaml` output, every GPU the classifier knows, and the API server's validation."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvpolicy.api.exit_codes import EXIT_USAGE
from kvpolicy.planning import cli as plan_cli
from kvpolicy.planning.gpu import PRODUCTS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llama-3.1-8b-h100-128k.yaml"
POLICY: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
H100_LABELS = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.compute.major": "9"}
A100_LABELS = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.compute.major": "8"}


def node(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A Node as `kubectl get node NAME -o yaml` prints it (abridged)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "spec": {"providerID": f"aws:///{name}"},
        "status": {"capacity": {"nvidia.com/gpu": "8"}},
    }


def run(capsys: pytest.CaptureFixture[str], *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    with pytest.MonkeyPatch.context() as patch:
        if stdin is not None:
            patch.setattr("sys.stdin", io.StringIO(stdin))
        code = plan_cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write(tmp_path: Path, name: str, content: Any) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else yaml.safe_dump_all(content))
    return str(path)


# --- --node-labels --------------------------------------------------------------------------------------------


def test_node_labels_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "-f", str(EXAMPLE), "--node-labels", str(tmp_path / "absent.yaml"))
    assert code == EXIT_USAGE
    assert f"cannot read node labels {tmp_path / 'absent.yaml'}: No such file or directory" in err


def test_node_labels_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "-f", str(EXAMPLE), "--node-labels", str(tmp_path))
    assert code == EXIT_USAGE and f"cannot read node labels {tmp_path}: Is a directory" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("nvidia.com/gpu.product: [unclosed\n", "not valid YAML"),
        ("", "no node labels found"),
        ("just a string\n", "document 1 is a str: expected a label map, a Node or a list of them"),
        ("a: {nested: map}\n", "labels must map names to values"),
        (yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}), "is a Pod: expected a Node"),
    ],
)
def test_node_labels_bad_content(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, message: str
) -> None:
    code, _, err = run(capsys, "-f", str(EXAMPLE), "--node-labels", write(tmp_path, "labels.yaml", content))
    assert code == EXIT_USAGE and message in err


def test_node_labels_from_stdin(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "-f", str(EXAMPLE), "--node-labels", "-", "-o", "yaml", stdin=yaml.safe_dump(H100_LABELS)
    )
    assert code == 0
    assert yaml.safe_load(out)["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"


def test_manifest_from_stdin(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-f", "-", "--gpu", "H100", "-o", "json", stdin=EXAMPLE.read_text())
    assert code == 0 and '"kvCacheDtype": "FP8"' in out


def test_only_one_input_can_be_stdin(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-f", "-", "--node-labels", "-", stdin="")
    assert code == EXIT_USAGE and "cannot both read stdin" in err


def test_a_kubectl_node_is_read_by_its_labels(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`kubectl get node gpu-1 -o yaml > node.yaml`: its metadata.labels, not the object's top-level keys."""
    path = write(tmp_path, "node.yaml", [node("gpu-1", H100_LABELS)])
    code, out, _ = run(capsys, "-f", str(EXAMPLE), "--node-labels", path, "-o", "yaml")
    result = yaml.safe_load(out)
    assert code == 0
    assert (result["gpu"]["generation"], result["gpu"]["product"]) == ("Hopper", "NVIDIA-H100-80GB-HBM3")
    assert result["plan"]["kvCacheDtype"] == "FP8"


@pytest.mark.parametrize("list_kind", ["List", "NodeList"])
def test_a_kubectl_node_list_is_every_node(capsys: pytest.CaptureFixture[str], tmp_path: Path, list_kind: str) -> None:
    """`kubectl get nodes -l pool=gpu -o yaml`: a List of Nodes; a mixed pool plans for its worst generation."""
    nodes = {"apiVersion": "v1", "kind": list_kind, "items": [node("h", H100_LABELS), node("a", A100_LABELS)]}
    code, out, _ = run(
        capsys, "-f", str(EXAMPLE), "--node-labels", write(tmp_path, "nodes.yaml", [nodes]), "-o", "yaml"
    )
    gpu = yaml.safe_load(out)["gpu"]
    assert code == 0
    assert (gpu["nodes"], gpu["mixed"], gpu["generation"]) == (2, True, "Ampere")


# --- --gpu ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_every_product_the_classifier_knows_is_a_gpu_choice(product: Any, capsys: pytest.CaptureFixture[str]) -> None:
    for spelling in (product.name, product.name.lower(), f"NVIDIA-{product.name}", product.gfd_product):
        code, out, err = run(capsys, "-f", str(EXAMPLE), "--gpu", spelling, "-o", "yaml")
        assert code == 0, err
        gpu = yaml.safe_load(out)["gpu"]
        assert gpu["generation"] == product.generation.value, spelling
        assert gpu["computeCapability"] == "{}.{}".format(*product.compute_capability), spelling


@pytest.mark.parametrize(
    ("spelling", "generation"),
    [("RTX 4090", "Ada"), ("NVIDIA-H100-80GB-HBM3-SHARED", "Hopper"), ("NVIDIA-GH200-480GB", "Hopper"), ("l4", "Ada")],
)
def test_gpu_spellings(capsys: pytest.CaptureFixture[str], spelling: str, generation: str) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLE), "--gpu", spelling, "-o", "yaml")
    assert code == 0 and yaml.safe_load(out)["gpu"]["generation"] == generation


def test_an_unknown_gpu_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-f", str(EXAMPLE), "--gpu", "TPU-v5")
    assert code == EXIT_USAGE and "unknown --gpu 'TPU-v5'" in err
    assert all(product.name in err for product in PRODUCTS)


def test_gpu_help_lists_the_classifiers_products() -> None:
    help_text = plan_cli._parser().format_help().replace("\n", " ")
    assert all(product.name in help_text for product in PRODUCTS)


# --- the API server's validation, offline ----------------------------------------------------------------------


def manifest(**changes: Any) -> dict[str, Any]:
    """The example with top-level or dotted spec changes."""
    document = yaml.safe_load(EXAMPLE.read_text())
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = document
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    return document


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"apiVersion": "kvpolicy.dev/v1"},
            "apiVersion: apiVersion must be kvpolicy.dev/v1alpha1 (got 'kvpolicy.dev/v1')",
        ),
        ({"spec.model.headDim": "128"}, "spec.model.headDim: Input should be a valid integer (got '128')"),
        ({"spec.workload.maxContextTokens": 2**63}, "less than or equal to 16777216 (got 9223372036854775808)"),
        ({"spec.rollout.paused": "yes"}, "spec.rollout.paused: Input should be a valid boolean (got 'yes')"),
        ({"metadata.name": "Llama_3.1"}, "metadata: name 'Llama_3.1' is not a valid DNS-1123 subdomain"),
        ({"metadata.name": "x" * 254}, "is not a valid DNS-1123 subdomain"),
        ({"metadata.namespace": "llm.serving"}, "namespace 'llm.serving' is not a valid DNS-1123 label"),
        (
            {"spec.workload.maxContextTokens": 262144},
            "workload.maxContextTokens must not exceed model.maxModelLen (262144 > 131072)",
        ),
        (
            {"spec.model.slidingWindow": {"count": 64, "windowTokens": 128}},
            "model.slidingWindow.count must not exceed model.numLayers (64 > 32)",
        ),
    ],
)
def test_what_the_api_server_refuses_plan_refuses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    code, out, err = run(capsys, "-f", write(tmp_path, "policy.yaml", [manifest(**changes)]), "--gpu", "H100")
    assert code == EXIT_USAGE and out == ""
    assert "the API server would refuse it" in err and message in err


def test_legal_names_with_dots_and_a_kvpolicy_list_are_planned(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    first, second = manifest(**{"metadata.name": "llama-3.1-8b"}), manifest(**{"metadata.name": "b" * 253})
    listed = {"apiVersion": "v1", "kind": "List", "items": [first, second]}
    code, out, err = run(capsys, "-f", write(tmp_path, "policies.yaml", [listed]), "--gpu", "H100", "-o", "json")
    assert code == 0, err
    assert out.count('"kvCacheDtype": "FP8"') == 2


def test_a_key_given_twice_is_refused_not_silently_overwritten(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = EXAMPLE.read_text().replace("spec:\n", "spec:\n  rollout: {bakeSeconds: 60}\n", 1)
    text += "  rollout: {bakeSeconds: 0}\n"
    code, out, err = run(capsys, "-f", write(tmp_path, "twice.yaml", text), "--gpu", "H100")
    assert (code, out) == (EXIT_USAGE, "")
    assert "found the key 'rollout' twice" in err and "line" in err and "Traceback" not in err


def test_a_kustomize_build_stream_plans_every_kvpolicy_in_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llama"}, "spec": {}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama"}, "spec": {}}
    second = manifest(**{"metadata.name": "second"})
    stream = [deployment, manifest(), service, second]
    code, out, err = run(capsys, "-f", write(tmp_path, "build.yaml", stream), "--gpu", "H100", "-o", "json")
    assert code == 0, err
    assert out.count('"kvCacheDtype": "FP8"') == 2
