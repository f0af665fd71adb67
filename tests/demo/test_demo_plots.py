from __future__ import annotations

from pathlib import Path

import pytest
from kvpolicy_dev.demo.plots import Curve, ItlPanel, LineFit, break_even, fit_line, plot_accuracy, plot_itl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LENGTHS = [256.0, 8192.0, 32768.0, 65536.0, 125000.0]


def test_fit_line_recovers_an_exact_line() -> None:
    fit = fit_line(LENGTHS, [4.37e-5 * x + 6.44 for x in LENGTHS])
    assert fit.slope == pytest.approx(4.37e-5)
    assert fit.intercept == pytest.approx(6.44)
    assert fit(1000.0) == pytest.approx(4.37e-5 * 1000 + 6.44)


def test_break_even_matches_the_published_h100_figure() -> None:
    # vLLM blog fits, Llama-3.1-8B on H100: break-even 7,010 tokens (from rounded coefficients: 7,000).
    bf16, fp8 = LineFit(4.37e-5, 6.44), LineFit(2.37e-5, 6.58)
    assert break_even(bf16, fp8) == pytest.approx(7000.0)


def test_no_break_even_when_fp8_never_or_always_wins() -> None:
    assert break_even(LineFit(1e-5, 6.0), LineFit(2e-5, 6.5)) is None  # steeper: never wins
    assert break_even(LineFit(2e-5, 6.5), LineFit(1e-5, 6.0)) is None  # wins from length 0


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [([1.0, 2.0], [1.0], "2 x values but 1 y values"), ([5.0, 5.0], [1.0, 2.0], "two distinct x values")],
)
def test_fit_line_rejects_unusable_data(x: list[float], y: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_line(x, y)


def test_figures_are_written_as_png(tmp_path: Path) -> None:
    curves = [Curve("BF16", [4096, 131072], [0.99, 0.91]), Curve("FP8 one-level", [4096, 131072], [0.95, 0.13])]
    accuracy = plot_accuracy(curves, "NIAH on H200", tmp_path / "niah.png")
    panel = ItlPanel(
        "H200",
        Curve("BF16", LENGTHS, [4.37e-5 * x + 6.44 for x in LENGTHS]),
        Curve("FP8", LENGTHS, [2.37e-5 * x + 6.58 for x in LENGTHS]),
    )
    assert panel.break_even == pytest.approx(7000.0)
    itl = plot_itl([panel, panel], tmp_path / "itl.png")
    for path in (accuracy, itl):
        assert path.read_bytes()[:8] == PNG_MAGIC
