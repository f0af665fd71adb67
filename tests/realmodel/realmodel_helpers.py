"""What the real-model tests share: how the servers are started, the canary that cannot see far, the gate's CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvpolicy.gate_programs.report import EXIT_CODES
from kvpolicy_dev.devcluster.cpu_vllm import RealVllmServer
from kvpolicy_dev.devcluster.pytest_plugin import REAL_MODEL_GATE_RUNS
from kvpolicy_dev.models import SMOLLM2_135M_INSTRUCT, sliding_window_args

SERVED_MODEL = "smollm2"
MAX_MODEL_LEN = SMOLLM2_135M_INSTRUCT.max_model_len
# The workload's longest prompt: the model's whole range less room for the answer.
WORKLOAD_LENGTH = 8000
# A canary broken where short prompts cannot see it: vLLM's own --hf-overrides make every layer a sliding-window
# layer of WINDOW tokens (the model files are untouched). Within the window it computes what the baseline does;
# beyond it, needles placed early in the prompt are out of every layer's reach.
WINDOW = 2048
SHORT_LENGTH = 1500


BF16_ARGS = (SERVED_MODEL, "--max-model-len", str(MAX_MODEL_LEN))
WINDOWED_ARGS = (*BF16_ARGS, *sliding_window_args(SMOLLM2_135M_INSTRUCT, WINDOW))
FP8_ARGS = (*BF16_ARGS, "--kv-cache-dtype", "fp8")
# The package's servers (conftest.py), by name.
SERVER_ARGS = {"baseline": BF16_ARGS, "windowed": WINDOWED_ARGS, "fp8": FP8_ARGS}


@dataclass(frozen=True)
class RealModelServers:
    """Real vLLM serving SmolLM2-135M-Instruct: the BF16 baseline, the sliding-window canary, the FP8-KV canary."""

    baseline: RealVllmServer
    windowed: RealVllmServer
    fp8: RealVllmServer


@dataclass(frozen=True)
class GateRun:
    report: dict[str, Any]
    exit_code: int
    log: str


def run_accuracy_gate(what: str, canary: str, baseline: str, length: int, *extra: str) -> GateRun:
    """`kvpolicy gate accuracy` as the gate Job runs it, with the CRD's defaults unless `extra` says otherwise; the
    run is recorded for the session's summary as `what`."""
    argv = [sys.executable, "-m", "kvpolicy", "gate", "accuracy", "--canary", canary, "--baseline", baseline]
    argv += ["--model", SERVED_MODEL, "--length", str(length), *extra]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    report = json.loads(done.stdout)
    REAL_MODEL_GATE_RUNS.append(
        f"{what} at {length} tokens: {report['verdict']} ({report.get('reason')}) after {report.get('samples')} "
        f"prompts, canary {report.get('canaryScore')} vs baseline {report.get('baselineScore')}, interval "
        f"{report.get('recoveryLow')}-{report.get('recoveryHigh')}, {seconds:.0f} s"
    )
    assert done.returncode == EXIT_CODES[report["verdict"]], (done.returncode, report, done.stderr[-3000:])
    return GateRun(report, done.returncode, done.stderr)
