from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvpolicy_dev.demo import figures
from kvpolicy_dev.sim.config import Gpu

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_figures_and_their_data_come_from_the_simulator(tmp_path: Path) -> None:
    data = figures.write_figures(tmp_path, accuracy_lengths=[4096, 65536], itl_lengths=[256, 32768, 125000])
    for name in (figures.ACCURACY_FIGURE, figures.ITL_FIGURE):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / figures.DATA_FILE).read_text()) == data
    accuracy = {line["label"]: line["accuracy"] for line in data["accuracy"]}  # type: ignore[attr-defined]
    bf16, unfixed = accuracy["H200 BF16"], accuracy["H200 FP8, unfixed image"]
    fixed, blackwell = accuracy["H200 FP8, two-level accumulation"], accuracy["B200 FP8, stock image"]
    # At 4k every configuration retrieves alike; at 64k only Hopper's truncating accumulator falls behind.
    assert unfixed[0] == pytest.approx(bf16[0], abs=0.01)
    assert unfixed[1] < bf16[1] - 0.1
    assert fixed[1] == pytest.approx(bf16[1], abs=0.01) and blackwell[1] == pytest.approx(bf16[1], abs=0.01)


def test_itl_panel_fits_recover_the_published_shape() -> None:
    hopper = figures.itl_panel(Gpu.H200, np.random.default_rng(1))
    blackwell = figures.itl_panel(Gpu.B200, np.random.default_rng(1))
    bf16, fp8 = hopper.fits
    assert fp8.slope / bf16.slope == pytest.approx(2.37 / 4.37, rel=0.1)  # FP8 reads half the KV bytes
    assert fp8.intercept > bf16.intercept
    # Published break-evens: ~7k tokens on Hopper, ~4k on Blackwell.
    assert hopper.break_even is not None and 5000 < hopper.break_even < 10000
    assert blackwell.break_even is not None and 2500 < blackwell.break_even < hopper.break_even
