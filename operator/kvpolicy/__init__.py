"""kvpolicy: roll out vLLM model servers with an FP8 KV cache safely."""

__version__ = "0.1.0"
