"""The report's figures: NIAH accuracy against context length, and decode ITL against input length with fitted lines.

Data in, PNG out: the caller samples the simulator's models; fitting and the break-even are pure functions here.
Figures are drawn with matplotlib's object API (no pyplot): no display, no GUI toolkit, no global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure


@dataclass(frozen=True)
class Curve:
    """One line of a figure: y against x, both as measured or sampled."""

    label: str
    x: Sequence[float]
    y: Sequence[float]


@dataclass(frozen=True)
class LineFit:
    slope: float
    intercept: float

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept


def fit_line(x: Sequence[float], y: Sequence[float]) -> LineFit:
    """Least-squares y = slope·x + intercept (at least two distinct x needed)."""
    if len(x) != len(y):
        raise ValueError(f"fit_line: {len(x)} x values but {len(y)} y values")
    if len(set(x)) < 2:
        raise ValueError("fit_line: needs at least two distinct x values")
    slope, intercept = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)
    return LineFit(float(slope), float(intercept))


def break_even(baseline: LineFit, candidate: LineFit) -> float | None:
    """The x above which `candidate` is below `baseline` (FP8's smaller slope pays for its larger intercept).

    None when the candidate is never better for x > 0, or always is (no crossing above 0).
    """
    if candidate.slope >= baseline.slope:
        return None
    crossing = (candidate.intercept - baseline.intercept) / (baseline.slope - candidate.slope)
    return crossing if crossing > 0 else None


_LINE_STYLES = ("-", "-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v")


def plot_accuracy(curves: Sequence[Curve], title: str, path: Path) -> Path:
    """Accuracy (0..1) against context length on a log2 axis."""
    figure = Figure(figsize=(7.0, 4.2))
    ax = figure.subplots()
    # Curves that coincide (BF16 and every accurate FP8) stay visible through their line styles and marker sizes.
    for index, curve in enumerate(curves):
        ax.plot(
            curve.x,
            [100 * value for value in curve.y],
            linestyle=_LINE_STYLES[index % len(_LINE_STYLES)],
            marker=_MARKERS[index % len(_MARKERS)],
            markersize=max(3, 9 - 2 * index),
            linewidth=max(1.0, 2.5 - 0.5 * index),
            label=curve.label,
        )
    ax.set_xscale("log", base=2)
    lengths = sorted({x for curve in curves for x in curve.x})
    ax.set_xticks(lengths, [f"{int(x) // 1024}k" if x >= 1024 else str(int(x)) for x in lengths])
    ax.set_ylim(0, 105)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("NIAH accuracy (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


@dataclass(frozen=True)
class ItlPanel:
    """One GPU's decode latency: BF16 and FP8 samples against input length."""

    title: str
    bf16: Curve
    fp8: Curve

    @property
    def fits(self) -> tuple[LineFit, LineFit]:
        return fit_line(self.bf16.x, self.bf16.y), fit_line(self.fp8.x, self.fp8.y)

    @property
    def break_even(self) -> float | None:
        return break_even(*self.fits)


def plot_itl(panels: Sequence[ItlPanel], path: Path) -> Path:
    """Per GPU: ITL samples, their fitted lines, and the break-even input length where FP8 starts to win."""
    figure = Figure(figsize=(6.0 * len(panels), 4.2))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        for curve, fit, colour in zip((panel.bf16, panel.fp8), panel.fits, ("tab:blue", "tab:orange"), strict=True):
            ax.scatter(curve.x, curve.y, s=12, color=colour, alpha=0.6, label=f"{curve.label} samples")
            span = np.linspace(0, max(curve.x), 50)
            ax.plot(
                span,
                [fit(x) for x in span],
                color=colour,
                label=f"{curve.label}: {fit.slope * 1000:.4f} ms/1k tok + {fit.intercept:.2f} ms",
            )
        crossing = panel.break_even
        if crossing is not None:
            ax.axvline(crossing, color="grey", linestyle="--", label=f"break-even {crossing:,.0f} tokens")
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel("inter-token latency (ms)")
        ax.set_title(panel.title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path
