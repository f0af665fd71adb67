"""Every kvpolicy command exits alike (issue 23 item 11): a usage error is 64 whether it is `kvpolicy`, `kvpolicy plan`,
`kvpolicy gate` or `kubectl kvpolicy`, and the README's table says what each code means."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvpolicy import cli
from kvpolicy.api import exit_codes
from kvpolicy.gate_programs import cli as gate_cli
from kvpolicy.planning import cli as plan_cli
from kvpolicy.plugin import cli as plugin_cli

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    "run",
    [
        lambda: plan_cli.main([]),
        lambda: plan_cli.main(["-f", "x.yaml", "--gpu", "H100", "--output", "xml"]),
        lambda: gate_cli.main(["accuracy"]),
        lambda: plugin_cli.main([]),
        lambda: plugin_cli.main(["get"]),
        lambda: plugin_cli.main(["status", "x", "--timeout", "soon"]),
    ],
)
def test_a_usage_error_exits_64_in_every_command(run: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert callable(run)
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code == exit_codes.EXIT_USAGE == 64
    assert "error:" in capsys.readouterr().err


def test_the_top_level_command_exits_64_for_an_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == exit_codes.EXIT_USAGE
    assert cli.main([]) == exit_codes.EXIT_USAGE
    assert cli.main(["--help"]) == exit_codes.EXIT_OK


def test_the_readme_table_has_every_code() -> None:
    section = README.read_text().split("### Exit codes", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    codes = {name: value for name, value in vars(exit_codes).items() if name.startswith("EXIT_")}
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(row.split("|")[1]) for row in rows] == sorted(codes.values())
