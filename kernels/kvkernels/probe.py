"""Preflight probe for the FP8 accumulation cliff: does FP8 attention on this GPU shrink long-context outputs?

    python -m kvkernels.probe --max-len 131072 --head-dim 128 --mode two-level --json

For each length from --min-len (4096, or --max-len if shorter) doubling up to --max-len, it runs FP8 attention of
--queries query rows against that many keys, with V drawn with a non-zero mean (real V rows have one; zero-mean V
hides the shrink), and compares the output with a float64 reference from the same FP8 inputs, and with the same
attention run in BF16. The verdict is Unsafe when at any length the mean signed shrink or the mean relative error
passes its threshold.

Exit codes: 0 Safe, 1 Unsafe, 2 could not run (no CUDA, backend unavailable, bad arguments).
The JSON result also goes to $KVPOLICY_TERMINATION_LOG, else /dev/termination-log when that file exists (<= 4 KiB).
`--device cpu` runs the same logic through Triton's CPU interpreter at tiny lengths: it tests the probe, not the GPU,
and cannot show the cliff (the interpreter accumulates in full precision).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvkernels import __version__ as kvkernels_version
from kvkernels.modes import AccumulationMode

DEFAULT_MIN_LEN = 4096
DEFAULT_SHRINK_THRESHOLD = 0.01
DEFAULT_ERROR_THRESHOLD = 0.01
TERMINATION_LOG_LIMIT = 4096
DEFAULT_TERMINATION_LOG = Path("/dev/termination-log")
EXIT_SAFE, EXIT_UNSAFE, EXIT_CANNOT_RUN = 0, 1, 2
BACKENDS = ("triton", "vllm-fa3")
# The report is the operator's GateReport (operator/kvpolicy/gate_programs/report.py), written here without depending
# on kvpolicy; tests/gates/test_gate_report_contract.py holds the two to the same JSON.
VERDICT_INCONCLUSIVE = "Inconclusive"
REASON_SAFE, REASON_UNSAFE, REASON_CANNOT_RUN = "AccumulationSafe", "AccumulationUnsafe", "ProbeCouldNotRun"


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (no CUDA, no vLLM, ...): exit code 2."""


@dataclass(frozen=True)
class LengthResult:
    length: int
    signed_shrink: float
    mean_rel_error: float
    bf16_mean_rel_error: float
    error_vs_bf16: float

    def as_json(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "signedShrink": self.signed_shrink,
            "meanRelError": self.mean_rel_error,
            "bf16MeanRelError": self.bf16_mean_rel_error,
            "errorVsBf16": self.error_vs_bf16,
        }


@dataclass(frozen=True)
class Thresholds:
    signed_shrink: float = DEFAULT_SHRINK_THRESHOLD
    mean_rel_error: float = DEFAULT_ERROR_THRESHOLD


@dataclass(frozen=True)
class Verdict:
    safe: bool
    reason: str


@dataclass
class ProbeReport:
    backend: str
    backend_version: str
    mode: str
    device: str
    head_dim: int
    max_len: int
    thresholds: Thresholds
    lengths: list[LengthResult] = field(default_factory=list)
    verdict: Verdict | None = None
    elapsed_seconds: float = 0.0
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        if self.verdict is None:
            raise ValueError("the report has no verdict yet")
        return {
            "gate": "preflight",
            "verdict": "Safe" if self.verdict.safe else "Unsafe",
            "reason": REASON_SAFE if self.verdict.safe else REASON_UNSAFE,
            "message": self.verdict.reason,
            "backend": self.backend,
            "backendVersion": self.backend_version,
            "mode": self.mode,
            "device": self.device,
            "headDim": self.head_dim,
            "maxLen": self.max_len,
            "threshold": {
                "signedShrink": self.thresholds.signed_shrink,
                "meanRelError": self.thresholds.mean_rel_error,
            },
            "lengths": [result.as_json() for result in self.lengths],
            "elapsedSeconds": round(self.elapsed_seconds, 3),
            "note": self.note,
        }


def cannot_run_report(message: str) -> dict[str, Any]:
    return {"gate": "preflight", "verdict": VERDICT_INCONCLUSIVE, "reason": REASON_CANNOT_RUN, "message": message}


def probe_lengths(min_len: int, max_len: int) -> list[int]:
    """min_len, 2·min_len, ... below max_len, then max_len itself."""
    if min_len < 1 or max_len < min_len:
        raise ValueError(f"need 1 <= --min-len ({min_len}) <= --max-len ({max_len})")
    lengths = []
    length = min_len
    while length < max_len:
        lengths.append(length)
        length *= 2
    return [*lengths, max_len]


def judge(results: Sequence[LengthResult], thresholds: Thresholds) -> Verdict:
    """Unsafe when any length shrinks or errs past its threshold; the reason names the first such length."""
    if not results:
        raise ValueError("no lengths were measured")
    for result in results:
        if abs(result.signed_shrink) > thresholds.signed_shrink:
            return Verdict(
                False,
                f"at {result.length} tokens the output changed by {result.signed_shrink:+.2%} in norm "
                f"(threshold ±{thresholds.signed_shrink:.2%}): FP8 accumulation loses precision",
            )
        if not result.mean_rel_error <= thresholds.mean_rel_error:  # catches NaN too
            return Verdict(
                False,
                f"at {result.length} tokens the mean relative error is {result.mean_rel_error:.2e} "
                f"(threshold {thresholds.mean_rel_error:.0e})",
            )
    worst_shrink = max(abs(r.signed_shrink) for r in results)
    worst_error = max(r.mean_rel_error for r in results)
    return Verdict(
        True,
        f"up to {results[-1].length} tokens: |shrink| <= {worst_shrink:.2%}, mean relative error <= "
        f"{worst_error:.2e} (thresholds ±{thresholds.signed_shrink:.2%}, {thresholds.mean_rel_error:.0e})",
    )


def termination_message(document: dict[str, Any], limit: int = TERMINATION_LOG_LIMIT) -> str:
    """The JSON for a Kubernetes termination log: whole if it fits, else without per-length detail."""
    text = json.dumps(document, separators=(",", ":"))
    if len(text.encode()) <= limit:
        return text
    lengths = document.get("lengths", [])
    short = {key: value for key, value in document.items() if key not in ("lengths", "note")}
    short["lengths"] = [lengths[-1]] if lengths else []
    text = json.dumps(short, separators=(",", ":"))
    if len(text.encode()) <= limit:
        return text
    essentials = {"verdict": document.get("verdict"), "reason": document.get("reason", "")}
    return json.dumps({**essentials, "message": str(document.get("message", ""))[:3000]})


def write_termination_log(document: dict[str, Any], environ: dict[str, str] | None = None) -> Path | None:
    """Writes the result where Kubernetes reads a container's termination message; returns the path used."""
    env = os.environ if environ is None else environ
    configured = env.get("KVPOLICY_TERMINATION_LOG")
    if configured:
        path = Path(configured)
    elif DEFAULT_TERMINATION_LOG.exists():
        path = DEFAULT_TERMINATION_LOG
    else:
        return None
    path.write_text(termination_message(document))
    return path


# --- measurement (torch and kernels are imported here, after the CPU interpreter may have been chosen) ---


AttentionFn = Callable[..., Any]


def _triton_backend(device: str, mode: AccumulationMode) -> tuple[AttentionFn, AttentionFn]:
    """(fp8 attention, bf16 attention) through this package's Triton kernels."""
    import torch

    from kvkernels.prefill import attention_prefill

    def fp8(q: Any, k: Any, v: Any, scales: tuple[float, float, float]) -> Any:
        q_scale, k_scale, v_scale = scales
        return attention_prefill(
            q, k, v, mode=mode, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out_dtype=torch.float32
        )

    def bf16(q: Any, k: Any, v: Any) -> Any:
        if device == "cpu":
            # Triton's interpreter mishandles bf16: on the CPU the BF16 twin is torch's fp32 attention of bf16 inputs.
            return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        return attention_prefill(q, k, v, out_dtype=torch.float32)

    return fp8, bf16


def vllm_fa3_attention() -> tuple[AttentionFn, AttentionFn]:
    """(fp8 attention, bf16 attention) through the FlashAttention-3 kernel that a vLLM image ships."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found, unused-ignore]
        from vllm.vllm_flash_attn.flash_attn_interface import (  # type: ignore[import-not-found, unused-ignore]
            fa_version_unsupported_reason,
            is_fa_version_supported,
        )
    except ImportError as error:
        raise ProbeUnavailable(f"backend vllm-fa3 needs vLLM importable (vllm.vllm_flash_attn): {error}") from None
    if not is_fa_version_supported(3):
        raise ProbeUnavailable(f"vLLM's FlashAttention-3 cannot run here: {fa_version_unsupported_reason(3)}")
    import torch

    def call(q: Any, k: Any, v: Any, descale: tuple[Any, Any, Any] | None) -> Any:
        # [1, H, L, D] -> varlen [L, H, D]; one sequence.
        seq_q, seq_k = q.shape[2], k.shape[2]
        qv, kv, vv = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
        cu_q = torch.tensor([0, seq_q], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, seq_k], dtype=torch.int32, device=q.device)
        extra: dict[str, Any] = {"fa_version": 3}
        if descale is not None:
            extra.update(q_descale=descale[0], k_descale=descale[1], v_descale=descale[2])
        out = flash_attn_varlen_func(
            qv, kv, vv, max_seqlen_q=seq_q, cu_seqlens_q=cu_q, max_seqlen_k=seq_k, cu_seqlens_k=cu_k, **extra
        )
        return out.float().transpose(0, 1)[None]

    def fp8(q: Any, k: Any, v: Any, scales: tuple[float, float, float]) -> Any:
        descale = tuple(torch.full((1, k.shape[1]), s, dtype=torch.float32, device=q.device) for s in scales)
        return call(q, k, v, descale)  # type: ignore[arg-type]

    def bf16(q: Any, k: Any, v: Any) -> Any:
        return call(q, k, v, None)

    return fp8, bf16


def _vllm_version() -> str:
    import vllm  # type: ignore[import-not-found, unused-ignore]

    return str(getattr(vllm, "__version__", "unknown"))


def measure_length(
    length: int,
    *,
    head_dim: int,
    heads: int,
    queries: int,
    v_mean: float,
    device: str,
    seed: int,
    fp8_attention: AttentionFn,
    bf16_attention: AttentionFn,
) -> LengthResult:
    """Signed shrink and errors of FP8 attention (and its BF16 twin) at one context length."""
    import torch

    from kvkernels.quant import quantize_fp8
    from kvkernels.reference import attention_reference, row_errors

    generator = torch.Generator(device=device).manual_seed(seed + length)
    shape_q, shape_kv = (1, heads, queries, head_dim), (1, heads, length, head_dim)
    q = torch.randn(shape_q, device=device, generator=generator)
    k = torch.randn(shape_kv, device=device, generator=generator)
    v = torch.randn(shape_kv, device=device, generator=generator) + v_mean
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    out8 = fp8_attention(q8, k8, v8, (q_scale, k_scale, v_scale))
    ref8 = attention_reference(q8, k8, v8, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    error, shrink = row_errors(out8, ref8)
    del ref8
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    outb = bf16_attention(qb, kb, vb)
    bf16_error, _ = row_errors(outb, attention_reference(qb, kb, vb))
    error_vs_bf16, _ = row_errors(out8, outb)
    return LengthResult(length, shrink, error, bf16_error, error_vs_bf16)


def _device_description(device: str) -> str:
    import torch

    if device == "cpu":
        return "cpu (Triton interpreter; cannot show the cliff)"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} (sm_{props.major}{props.minor}, torch {torch.__version__})"


def run_probe(args: argparse.Namespace) -> ProbeReport:
    """Measures every length and judges; raises ProbeUnavailable when it cannot run here."""
    started = time.perf_counter()
    mode = AccumulationMode(args.mode)
    if args.backend == "vllm-fa3":
        if args.device != "cuda":
            raise ProbeUnavailable("backend vllm-fa3 runs on CUDA only")
        fp8_attention, bf16_attention = vllm_fa3_attention()
        mode_name = "backend's own (FA3 as built into this vLLM)"
        backend_version = f"vllm {_vllm_version()} FlashAttention-3"
    elif args.device == "cpu":
        if "kvkernels._prefill_kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise ProbeUnavailable("--device cpu needs a fresh process: the GPU kernels are already compiled here")
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ProbeUnavailable("no CUDA device is visible (use --device cpu only to test the probe's logic)")
        major, minor = torch.cuda.get_device_capability(0)
        if (major, minor) < (8, 9):
            raise ProbeUnavailable(f"this GPU (sm_{major}{minor}) has no FP8 tensor cores; FP8 KV needs sm_89+")
    if args.backend == "triton":
        fp8_attention, bf16_attention = _triton_backend(args.device, mode)
        mode_name = mode.value
        import triton

        backend_version = f"kvkernels {kvkernels_version}, triton {triton.__version__}"
    report = ProbeReport(
        backend=args.backend,
        backend_version=backend_version,
        mode=mode_name,
        device=_device_description(args.device),
        head_dim=args.head_dim,
        max_len=args.max_len,
        thresholds=Thresholds(args.shrink_threshold, args.error_threshold),
    )
    if args.device == "cpu":
        report.note = "CPU interpreter run: tests the probe's logic; only a GPU can show the accumulation cliff"
    for length in probe_lengths(args.min_len, args.max_len):
        report.lengths.append(
            measure_length(
                length,
                head_dim=args.head_dim,
                heads=args.heads,
                queries=args.queries,
                v_mean=args.v_mean,
                device=args.device,
                seed=args.seed,
                fp8_attention=fp8_attention,
                bf16_attention=bf16_attention,
            )
        )
        if args.device == "cuda":
            torch.cuda.empty_cache()
    report.verdict = judge(report.lengths, report.thresholds)
    report.elapsed_seconds = time.perf_counter() - started
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvkernels.probe", description="Detect the FP8 attention accumulation cliff on this GPU."
    )
    parser.add_argument("--max-len", type=int, required=True, help="longest context to test (tokens)")
    parser.add_argument("--head-dim", type=int, required=True, choices=(64, 128, 256))
    parser.add_argument("--backend", choices=BACKENDS, default="triton")
    parser.add_argument("--mode", choices=[m.value for m in AccumulationMode], default="two-level")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--min-len", type=int, help="shortest context (default 4096, or --max-len if shorter); lengths double from it"
    )
    parser.add_argument("--heads", type=int, default=4, help="attention heads (rows of the statistics)")
    parser.add_argument("--queries", type=int, default=128, help="query rows per head")
    parser.add_argument("--v-mean", type=float, default=1.0, help="mean of V (zero-mean V hides the shrink)")
    parser.add_argument("--shrink-threshold", type=float, default=DEFAULT_SHRINK_THRESHOLD)
    parser.add_argument("--error-threshold", type=float, default=DEFAULT_ERROR_THRESHOLD)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    return parser


def _print_table(report: ProbeReport) -> None:
    print(f"{report.device}; backend {report.backend}, mode {report.mode}, head_dim {report.head_dim}")
    print(f"{'length':>8} {'shrink':>9} {'rel.err':>9} {'bf16 err':>9} {'vs bf16':>9}")
    for r in report.lengths:
        print(
            f"{r.length:>8} {r.signed_shrink:>+9.3%} {r.mean_rel_error:>9.2e} "
            f"{r.bf16_mean_rel_error:>9.2e} {r.error_vs_bf16:>9.2e}"
        )
    verdict = report.verdict
    assert verdict is not None
    print(f"{'Safe' if verdict.safe else 'Unsafe'}: {verdict.reason} ({report.elapsed_seconds:.1f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.min_len is None:
        args.min_len = min(DEFAULT_MIN_LEN, args.max_len)
    try:
        probe_lengths(args.min_len, args.max_len)
        report = run_probe(args)
    except (ProbeUnavailable, ValueError) as error:
        message = f"probe could not run: {error}"
        document = cannot_run_report(message)
        print(json.dumps(document) if args.json else message, file=sys.stdout)
        write_termination_log(document)
        return EXIT_CANNOT_RUN
    document = report.as_json()
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        _print_table(report)
    write_termination_log(document)
    return EXIT_SAFE if report.verdict is not None and report.verdict.safe else EXIT_UNSAFE


if __name__ == "__main__":
    sys.exit(main())
