"""`kvpolicy sim` as a command: flags, errors, and a real subprocess on a free port."""

import json
import urllib.request

import pytest
from kvpolicy_dev.sim import start_simulator_subprocess
from kvpolicy_dev.sim.cli import build_parser, config_from_args, main


def test_flags_mirror_vllm_serve_and_the_model_names_the_server() -> None:
    args = build_parser().parse_args(
        [
            *("org/model", "--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window", "0", "3"),
            *("--attention-backend", "FLASH_ATTN", "--max-model-len", "32768", "--gpu", "h200", "--two-level-fix"),
        ]
    )
    config = config_from_args(args)
    assert config.served_model_name == "org/model"
    assert config.skip_layers == ("sliding_window", "0", "3")
    assert (config.gpu.value, config.two_level_fix, config.max_model_len) == ("h200", True, 32768)
    named = config_from_args(build_parser().parse_args(["org/model", "--served-model-name", "short"]))
    assert named.served_model_name == "short"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--gpu", "v100"], "invalid choice: 'v100'"),
        (["--port", "99999"], "argument --port: 99999 is not a TCP port (0 to 65535)"),
        (["--port", "http"], "argument --port: 'http' is not a port number"),
        (["--kv-cache-dtype-skip-layers", "every_other"], "--kv-cache-dtype-skip-layers takes"),
        (["--kv-scale-error", "1.5"], "kv_scale_error must be in [0, 1), got 1.5"),
        (
            ["openai/gpt-oss-20b", "--num-layers", "8"],
            "sliding_window_layers must be between 0 and num_layers - 1 (7), got 12 (shape flags not given come "
            "from model profile gpt-oss-20b)",
        ),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_subprocess_serves_on_a_free_port() -> None:
    with (
        start_simulator_subprocess(["my/model", "--max-model-len", "2048", "--time-scale", "0"]) as url,
        urllib.request.urlopen(f"{url}/v1/models") as response,
    ):
        card = json.load(response)["data"][0]
    assert (card["id"], card["max_model_len"]) == ("my/model", 2048)


def test_a_simulator_that_cannot_start_raises_with_its_error() -> None:
    with (
        pytest.raises(RuntimeError, match=r"exited with code 2(.|\n)*invalid choice: 'v100'"),
        start_simulator_subprocess(["--gpu", "v100"]),
    ):
        pass
