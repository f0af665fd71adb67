"""Imported at start-up by every Python process of a CPU vLLM server (cpu_vllm_entrypoint puts this folder first on
PYTHONPATH): ask Linux for AMX tile permission before any kernel uses AMX.

vLLM 0.32's CPU attention kernel picks AMX on CPUs that have it, but in eager mode nothing requests the permission
first (torch.compile's warm-up does, through inductor), so the first request dies of SIGILL in the engine process.
"""

import torch

torch.cpu._init_amx()
