"""FP8 attention with two-level accumulation (Triton) and a preflight probe for Hopper's accumulation cliff.

Kernel modules (`kvkernels.prefill`, `kvkernels.decode`) are imported on demand, so that a caller can still choose
Triton's CPU interpreter (TRITON_INTERPRET=1) before they are defined.
"""

from kvkernels.modes import AccumulationMode, parse_mode

__all__ = ["AccumulationMode", "parse_mode"]
__version__ = "0.1.0"
