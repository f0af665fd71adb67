"""The real-vLLM harness's pure parts (no vLLM needed): what the kubelet runs for a vLLM pod, how an image's quirks
change its arguments, what the CPU entrypoint hands vLLM, and where accuracy gate Jobs are sent in the demo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kvpolicy_dev.devcluster.cpu_vllm import (
    CPU_RUNTIME_ARGS,
    ENTRYPOINT_MODULE,
    KV_CACHE_MIN_BYTES,
    MODEL_CONFIG,
    RANDOM_WEIGHTS_ARGS,
    RealVllmRunner,
    ServedModel,
)
from kvpolicy_dev.devcluster.cpu_vllm_entrypoint import ServeRequest, cpu_arguments
from kvpolicy_dev.devcluster.runners import EntrypointQuirk, SimulatorRunner, drop_flags

H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}
PLAN = ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window", "0", "--attention-backend",
        "FLASH_ATTN"]  # fmt: skip


def vllm_container(image: str = "vllm:test") -> dict[str, object]:
    return {
        "image": image,
        "command": ["vllm", "serve"],
        "args": ["llama", "--max-model-len", "8192", *PLAN],
        "ports": [{"containerPort": 8000}],
    }


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--kv-cache-dtype"],
            ["llama", "--kv-cache-dtype-skip-layers", "sliding_window", "0", "--attention-backend", "FLASH_ATTN"],
        ),
        (["--kv-cache-dtype-skip-layers"], ["llama", "--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]),
        (["--attention-backend", "--kv-cache-dtype"], ["llama", "--kv-cache-dtype-skip-layers", "sliding_window", "0"]),
        ([], ["llama", *PLAN]),
    ],
)
def test_drop_flags_removes_a_flag_with_all_its_values(flags: list[str], expected: list[str]) -> None:
    assert drop_flags(["llama", *PLAN], flags) == expected


def test_drop_flags_handles_the_equals_form() -> None:
    assert drop_flags(["m", "--kv-cache-dtype=fp8", "--port", "1"], ["--kv-cache-dtype"]) == ["m", "--port", "1"]


def test_a_quirk_drops_then_adds() -> None:
    quirk = EntrypointQuirk(drop=("--kv-cache-dtype",), add=("--kv-cache-dtype", "fp8_e5m2"))
    assert quirk.apply(["m", "--kv-cache-dtype", "fp8", "--port", "1"]) == ["m", "--port", "1", "--kv-cache-dtype",
                                                                            "fp8_e5m2"]  # fmt: skip


def test_the_simulator_runner_applies_an_images_quirk() -> None:
    lossy = SimulatorRunner(quirks={"lossy:1": EntrypointQuirk(drop=("--kv-cache-dtype",))})
    faithful = lossy.argv(vllm_container(), H200, "127.0.0.5")
    dropped = lossy.argv(vllm_container("lossy:1"), H200, "127.0.0.5")
    assert faithful is not None and dropped is not None
    assert "--kv-cache-dtype" in faithful and "--kv-cache-dtype" not in dropped
    assert "--kv-cache-dtype-skip-layers" in dropped


def test_the_real_vllm_runner_passes_the_pod_specs_arguments_unchanged(tmp_path: Path) -> None:
    runner = RealVllmRunner(tmp_path, quirks={"lossy:1": EntrypointQuirk(drop=("--kv-cache-dtype",))})
    argv = runner.argv(vllm_container(), H200, "127.0.0.5")
    assert argv is not None and argv[:3] == [sys.executable, "-m", ENTRYPOINT_MODULE]
    own, serve_args = argv[3 : argv.index("--")], argv[argv.index("--") + 1 :]
    assert own == ["--model-dir", str(tmp_path), "--host", "127.0.0.5", "--port", "8000"]
    assert serve_args == ["llama", "--max-model-len", "8192", *PLAN]
    lossy = runner.argv(vllm_container("lossy:1"), H200, "127.0.0.5")
    assert lossy is not None and "--entrypoint-drops=--kv-cache-dtype" in lossy
    assert runner.argv({"image": "busybox", "command": ["sleep", "1"]}, H200, "127.0.0.5") is None


def tiny_config(directory: Path) -> Path:
    directory.joinpath("config.json").write_text(json.dumps(MODEL_CONFIG))
    return directory


def test_the_entrypoint_serves_the_model_directory_under_the_containers_name(tmp_path: Path) -> None:
    tiny = ServedModel.read(tiny_config(tmp_path))
    request = ServeRequest("llama", None, 8192, {"--attention-backend": "FLASH_ATTN"})
    arguments = cpu_arguments(["llama", "--max-model-len", "8192", *PLAN], request, tmp_path, "127.0.0.5", 8000)
    assert arguments == [
        "--model", str(tmp_path), "--max-model-len", "8192", "--kv-cache-dtype", "fp8",
        "--kv-cache-dtype-skip-layers", "sliding_window", "0", "--served-model-name", "llama", *RANDOM_WEIGHTS_ARGS,
        *CPU_RUNTIME_ARGS, "--kv-cache-memory-bytes", str(tiny.kv_cache_bytes(8192)), "--host", "127.0.0.5",
        "--port", "8000",
    ]  # fmt: skip
    named = ServeRequest("llama", ["chat"], None, {})
    arguments = cpu_arguments(["llama", "--served-model-name", "chat"], named, tmp_path, "h", 1)
    assert arguments.count("--served-model-name") == 1
    assert arguments[arguments.index("--kv-cache-memory-bytes") + 1] == str(tiny.kv_cache_bytes(131072))


def test_a_multi_host_leaders_group_flags_are_left_out_on_cpu_where_one_process_serves_the_group(
    tmp_path: Path,
) -> None:
    tiny_config(tmp_path)
    group = ["-tp", "8", "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "l-0.l"]
    request = ServeRequest("llama", None, 4096, {})
    arguments = cpu_arguments(["llama", *group, "--max-model-len", "4096"], request, tmp_path, "h", 1)
    assert not set(group) & set(arguments)
    assert arguments[:4] == ["--model", str(tmp_path), "--max-model-len", "4096"]


def test_a_directory_with_weights_is_served_with_them(tmp_path: Path) -> None:
    tiny_config(tmp_path).joinpath("model.safetensors").write_bytes(b"")
    arguments = cpu_arguments(["llama"], ServeRequest("llama", None, 4096, {}), tmp_path, "h", 1)
    assert "--load-format" not in arguments and arguments[arguments.index("--enforce-eager") - 1] == "llama"


def test_the_kv_cache_holds_two_sequences_of_max_model_len(tmp_path: Path) -> None:
    tiny = ServedModel.read(tiny_config(tmp_path))
    assert tiny.kv_cache_bytes(1024) == KV_CACHE_MIN_BYTES
    assert tiny.kv_cache_bytes(131072) == 2 * 131072 * 2 * 2 * 64 * 2 * 2
