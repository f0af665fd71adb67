"""Chooses Triton's CPU interpreter when no CUDA device is visible, before any kernel module is imported.

Triton reads TRITON_INTERPRET when a kernel is defined (@triton.jit), so this must run before kvkernels.prefill and
kvkernels.decode are imported; pytest loads this file before the test modules of this folder.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton 3.9 warns on every kernel while this default is unset; keep its current behaviour.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def device() -> str:
    """Where kernel tests run: the CPU interpreter, or the GPU when there is one."""
    return "cpu" if INTERPRETED else "cuda"
