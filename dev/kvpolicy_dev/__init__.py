"""kvpolicy's development distribution: the emulated cluster, the vLLM simulator, the FP8 numerics emulator and the
demo. None of it runs in the operator or its gate Jobs; the operator image does not contain it."""
