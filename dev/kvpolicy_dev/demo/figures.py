"""The report's figures, sampled from the simulator's own models: `python -m kvpolicy_dev.demo.figures OUT_DIR`.

It runs as a separate, low-priority process while the rollout runs: emulating FP8 accumulation over a 128k context
costs seconds of CPU, which must not stall the emulated API server in the demo's own process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvpolicy_dev.demo.plots import Curve, ItlPanel, plot_accuracy, plot_itl
from kvpolicy_dev.sim.accuracy import NumericsModel
from kvpolicy_dev.sim.config import Gpu, SimConfig
from kvpolicy_dev.sim.latency import latency_fit, sample_latencies

ACCURACY_FIGURE = "niah_accuracy.png"
ITL_FIGURE = "itl_vs_length.png"
DATA_FILE = "figures.json"
ACCURACY_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
# The published fits span inputs of 256..125k tokens at concurrency 1 with 128 output tokens.
ITL_LENGTHS = tuple(int(x) for x in np.linspace(256, 125_000, 25))
ITL_OUTPUT_TOKENS = 128


def llama_8b(gpu: Gpu, kv_cache_dtype: str = "auto", *, two_level_fix: bool = False) -> SimConfig:
    """Llama-3.1-8B, the model of the published fits and of the demo's long-document scenarios."""
    return SimConfig(
        served_model_name="meta-llama/Llama-3.1-8B-Instruct",
        head_dim=128,
        num_layers=32,
        gpu=gpu,
        kv_cache_dtype=kv_cache_dtype,
        two_level_fix=two_level_fix,
    )


@dataclass(frozen=True)
class AccuracyLine:
    label: str
    config: SimConfig


ACCURACY_LINES = (
    AccuracyLine("H200 BF16", llama_8b(Gpu.H200)),
    AccuracyLine("H200 FP8, unfixed image", llama_8b(Gpu.H200, "fp8")),
    AccuracyLine("H200 FP8, two-level accumulation", llama_8b(Gpu.H200, "fp8", two_level_fix=True)),
    AccuracyLine("B200 FP8, stock image", llama_8b(Gpu.B200, "fp8")),
)


async def accuracy_curve(line: AccuracyLine, lengths: Sequence[int]) -> Curve:
    """Expected NIAH accuracy per length: the model's capability times the numerics' survival, as the sim answers."""
    model = NumericsModel(line.config)
    values = []
    for length in lengths:
        capability, survival = await model.retrieval_probability(length)
        values.append(capability * survival)
    return Curve(line.label, [float(x) for x in lengths], values)


def itl_panel(gpu: Gpu, rng: np.random.Generator, lengths: Sequence[int] = ITL_LENGTHS) -> ItlPanel:
    """Mean ITL of one simulated request per input length, for BF16 and FP8 (fixed image) on one GPU."""
    curves = []
    for label, dtype in (("BF16", "auto"), ("FP8", "fp8")):
        fit = latency_fit(llama_8b(gpu, dtype, two_level_fix=True))
        means = [float(np.mean(sample_latencies(fit, n, ITL_OUTPUT_TOKENS, 1, rng)[1])) for n in lengths]
        curves.append(Curve(label, [float(n) for n in lengths], means))
    return ItlPanel(f"Llama-3.1-8B on {gpu.value.upper()}", curves[0], curves[1])


def _panel_data(panel: ItlPanel) -> dict[str, object]:
    bf16, fp8 = panel.fits
    return {"title": panel.title, "bf16": asdict(bf16), "fp8": asdict(fp8), "breakEvenTokens": panel.break_even}


async def accuracy_curves(lengths: Sequence[int] = ACCURACY_LENGTHS) -> list[Curve]:
    return [await accuracy_curve(line, lengths) for line in ACCURACY_LINES]


def write_figures(
    directory: Path,
    *,
    accuracy_lengths: Sequence[int] = ACCURACY_LENGTHS,
    itl_lengths: Sequence[int] = ITL_LENGTHS,
    seed: int = 0,
) -> dict[str, object]:
    """Both figures and their data (curves, fits, break-even lengths) as figures.json."""
    directory.mkdir(parents=True, exist_ok=True)
    curves = asyncio.run(accuracy_curves(accuracy_lengths))
    plot_accuracy(curves, "NIAH accuracy against context length (simulator)", directory / ACCURACY_FIGURE)
    rng = np.random.default_rng(seed)
    panels = [itl_panel(Gpu.H200, rng, itl_lengths), itl_panel(Gpu.B200, rng, itl_lengths)]
    plot_itl(panels, directory / ITL_FIGURE)
    data: dict[str, object] = {
        "accuracy": [{"label": c.label, "lengths": list(c.x), "accuracy": list(c.y)} for c in curves],
        "itl": [_panel_data(panel) for panel in panels],
    }
    (directory / DATA_FILE).write_text(json.dumps(data, indent=1))
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpolicy_dev.demo.figures", description=__doc__)
    parser.add_argument("directory", type=Path, help="where to write the PNGs and figures.json")
    parser.add_argument("--nice", type=int, default=5, help="lower this process's CPU priority by this much")
    args = parser.parse_args(argv)
    os.nice(args.nice)
    write_figures(args.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
