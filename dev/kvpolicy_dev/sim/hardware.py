"""The GPUs a simulator can pretend to run on."""

from __future__ import annotations

import enum


class Gpu(enum.StrEnum):
    H100 = "h100"
    H200 = "h200"
    B200 = "b200"
    A100 = "a100"
    L40S = "l40s"

    @property
    def compute_capability(self) -> tuple[int, int]:
        return {
            Gpu.H100: (9, 0),
            Gpu.H200: (9, 0),
            Gpu.B200: (10, 0),
            Gpu.A100: (8, 0),
            Gpu.L40S: (8, 9),
        }[self]
