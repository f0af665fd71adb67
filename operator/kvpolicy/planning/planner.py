"""The planner: a pure function from a KVPolicy spec and GPU facts to a plan with its reasons.

Hard rules cannot be overridden by `kvCache.dtype: FP8`: FP8 is never planned on an unknown GPU, on a truncating
FP8 accumulator (Hopper, Ada) without an image that declares two-level accumulation, for MLA without calibrated
scales, or where no attention backend runs an FP8 KV cache on the GPU for the model (attention.py). Soft rules
(decode break-even, head_dim-256 prefill penalty, no FP8 tensor cores) choose BF16 under `Auto` and give way to an
explicit `FP8` with a warning. An explicit `BF16` is always honoured, with a warning when the rules would have planned
FP8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpolicy.api.reasons import BF16_CAUSES, PlanCode
from kvpolicy.api.v1alpha1 import (
    AttentionKind,
    GpuFacts,
    GpuGeneration,
    ImageFeature,
    KVCacheDtype,
    KVPolicySpec,
    KVScales,
    Plan,
    PlanReason,
    Severity,
    SkipSlidingWindowLayers,
)
from kvpolicy.planning.attention import (
    BACKENDS,
    PROBE_BACKENDS,
    TWO_LEVEL_BACKENDS,
    Capability,
    Choice,
    choose_backend,
    pool,
)
from kvpolicy.planning.vllm_versions import Version, known_bad, known_versions, parse_version, release

# Published decode break-even (vLLM blog 2026-04-22, Llama-3.1-8B): FP8's lower ITL slope pays for its higher
# intercept only above these context lengths.
DEFAULT_BREAK_EVEN_TOKENS = {
    GpuGeneration.HOPPER: 7010,
    GpuGeneration.ADA: 7010,
    GpuGeneration.BLACKWELL: 4000,
    GpuGeneration.AMPERE: 0,
}
# Sliding-window layers are "many and small" (skip them) when they are at least this share of all layers and
# their window is at most this many tokens: their KV is tiny, so FP8 saves little and only adds error.
SKIP_SW_MIN_LAYER_SHARE = 0.25
SKIP_SW_MAX_WINDOW_TOKENS = 4096

GATE_PREFLIGHT = "GpuPreflight"
GATE_ACCURACY = "Accuracy"
GATE_LATENCY = "Latency"

TRUNCATING_ACCUMULATORS = (GpuGeneration.HOPPER, GpuGeneration.ADA)


@dataclass
class _Draft:
    fp8: bool = True
    hard_refusal: bool = False
    backend: str | None = None
    reasons: list[PlanReason] = field(default_factory=list)

    def say(self, code: PlanCode, message: str, severity: Severity = Severity.INFO) -> None:
        self.reasons.append(PlanReason(code=code, message=message, severity=severity))

    def refuse(self, code: PlanCode, message: str) -> None:
        """A hard rule: BF16 whatever the spec asks."""
        self.fp8 = False
        self.hard_refusal = True
        self.say(code, message, Severity.WARNING)

    def soft_bf16(self, code: PlanCode, message: str) -> None:
        self.fp8 = False
        self.say(code, message)


def _rules(spec: KVPolicySpec, gpu: GpuFacts) -> _Draft:
    """Apply every rule as if dtype were Auto; the caller then reconciles with an explicit dtype."""
    draft = _Draft()
    generation = gpu.generation
    if gpu.mixed:
        draft.say(PlanCode.MIXED_GPU_GENERATIONS, gpu.message, Severity.WARNING)

    if generation == GpuGeneration.UNKNOWN:
        draft.refuse(
            PlanCode.UNKNOWN_GPU,
            f"GPU generation unknown ({gpu.message}): FP8 attention numerics cannot be vouched for",
        )
        return draft

    if generation in TRUNCATING_ACCUMULATORS:
        name = gpu.product or generation.value
        features = spec.images.fp8_patched_features
        if spec.images.fp8_patched is None or ImageFeature.TWO_LEVEL_ACCUMULATION not in features:
            draft.refuse(
                PlanCode.NO_TWO_LEVEL_IMAGE,
                f"{name} FP8 tensor cores truncate while accumulating, so long-context attention shrinks "
                "(-57% at 128k on an H200); set images.fp8Patched to an image with TwoLevelAccumulation",
            )
            return draft
    elif generation == GpuGeneration.BLACKWELL:
        draft.say(
            PlanCode.BLACKWELL_NO_FIX_NEEDED, "Blackwell FP8 attention (FlashInfer) accumulates without truncation"
        )
        if (gpu.compute_capability or "").startswith("12."):
            draft.say(
                PlanCode.UNMEASURED_COMPUTE_CAPABILITY,
                f"{gpu.product or 'this GPU'} is compute capability {gpu.compute_capability}: no published "
                "measurement of its FP8 attention accumulation (B200's is 10.0); planned like B200, so the accuracy "
                "gate at the workload's length is the only evidence",
                Severity.WARNING,
            )
    elif generation == GpuGeneration.AMPERE:
        draft.soft_bf16(
            PlanCode.NO_FP8_TENSOR_CORES,
            f"{gpu.product or 'Ampere'} (compute capability {gpu.compute_capability or '8.x'}) has no FP8 tensor "
            "cores: an FP8 KV cache only saves memory and decode is not faster; set kvCache.dtype FP8 to take it",
        )

    mla = spec.model.attention == AttentionKind.MLA
    if mla and spec.kv_cache.scales != KVScales.CALIBRATED:
        draft.refuse(
            PlanCode.MLA_REQUIRES_CALIBRATED_SCALES,
            "MLA attention (FlashMLA) shifts outputs with uncalibrated FP8 scales; set kvCache.scales Calibrated "
            "with kvCache.scalesSource",
        )
        return draft

    version = _version(spec, draft)

    def avoid(name: str, capability: Capability) -> str | None:
        bad = known_bad(capability, name, "fp8", version)
        return None if bad is None else bad.describe()

    if spec.kv_cache.attention_backend is not None:
        choice = _requested_backend(spec, gpu, mla, avoid, draft)
    else:
        choice = choose_backend(
            generation, gpu.compute_capability, mla, spec.model.head_dim, gpu.pool_capabilities, avoid
        )
    if choice.backend is None:
        draft.refuse(PlanCode.NO_FP8_ATTENTION_BACKEND, f"{choice.reason}: the canary could not start")
        return draft
    draft.backend = choice.backend
    for avoided in choice.avoided:
        draft.say(PlanCode.KNOWN_BAD_COMBINATION, avoided)
    if generation in TRUNCATING_ACCUMULATORS:
        _say_accumulation(spec, gpu, choice.backend, draft)

    break_even = spec.workload.decode_break_even_tokens or DEFAULT_BREAK_EVEN_TOKENS.get(generation, 0)
    typical = spec.workload.typical_tokens
    if break_even and typical < break_even:
        draft.soft_bf16(
            PlanCode.BELOW_DECODE_BREAK_EVEN,
            f"typical context {typical} tokens is below the decode break-even of {break_even} tokens on "
            f"{generation.value}: FP8's higher per-step cost outweighs its smaller KV reads",
        )
    elif break_even:
        draft.say(
            PlanCode.ABOVE_DECODE_BREAK_EVEN,
            f"typical context {typical} tokens is above the decode break-even of {break_even} tokens: "
            "FP8 decodes faster",
        )

    if spec.model.head_dim >= 256 and generation in TRUNCATING_ACCUMULATORS and not mla:
        if ImageFeature.FAST_HEAD_DIM_256 in spec.images.fp8_patched_features:
            draft.say(
                PlanCode.FAST_HEAD_DIM_256_PATH,
                "the patched image declares a head_dim-256 path without the prefill penalty",
            )
        elif spec.workload.prefill_latency_critical:
            draft.soft_bf16(
                PlanCode.HEAD_DIM_256_PREFILL_PENALTY,
                f"head_dim {spec.model.head_dim} with two-level accumulation raises TTFT ~1.6x and the workload is "
                "prefill-latency critical",
            )
        else:
            draft.say(
                PlanCode.HEAD_DIM_256_PREFILL_COST,
                f"head_dim {spec.model.head_dim}: two-level accumulation raises TTFT ~1.6x; accepted because the "
                "workload is not prefill-latency critical",
                Severity.WARNING,
            )

    return draft


def _say_accumulation(spec: KVPolicySpec, gpu: GpuFacts, backend: str, draft: _Draft) -> None:
    """On a truncating GPU, whether the planned backend is one the fix is in: an image's TwoLevelAccumulation
    declaration speaks for vLLM's FA3, the only backend that promotes partial sums."""
    name = gpu.product or gpu.generation.value
    if backend in TWO_LEVEL_BACKENDS:
        draft.say(
            PlanCode.TWO_LEVEL_ACCUMULATION_IMAGE,
            f"{name} truncates FP8 accumulation; {spec.images.fp8_patched} runs vLLM's FA3 ({backend}), which "
            "promotes partial sums per tile (two-level accumulation: flash-attention#104, vllm#27889)",
        )
        return
    draft.say(
        PlanCode.BACKEND_WITHOUT_TWO_LEVEL,
        f"{name} truncates FP8 accumulation and only vLLM's FA3 (FLASH_ATTN, compute capability 9.x) promotes partial "
        f"sums: {backend} has no two-level accumulation whatever {spec.images.fp8_patched} declares, so the accuracy "
        "gate at the workload's length is what stands between its error and users",
        Severity.WARNING,
    )


def _version(spec: KVPolicySpec, draft: _Draft) -> Version | None:
    """The declared vLLM version when the table has a row for it; None (every known-bad combination counts) when none
    is declared or the table does not know it. Says which."""
    declared = spec.images.vllm_version
    if declared is None:
        draft.say(
            PlanCode.VLLM_VERSION_UNDECLARED,
            "no vLLM version declared (images.vllmVersion): planned with vLLM 0.32's backend table, avoiding every "
            f"known-bad combination (the version table knows {known_versions()})",
        )
        return None
    version = parse_version(declared)
    row = release(version)
    if row is None:
        draft.say(
            PlanCode.VLLM_VERSION_OUTSIDE_TABLE,
            f"vLLM {declared} is outside the version table ({known_versions()}): planned conservatively, with the "
            "backend table of vLLM 0.32 and avoiding every known-bad combination; check its flags before rolling out",
            Severity.WARNING,
        )
        return None
    draft.say(PlanCode.VLLM_VERSION, f"vLLM {declared}: the version table's {row.versions.describe()} row")
    return version


def _requested_backend(
    spec: KVPolicySpec, gpu: GpuFacts, mla: bool, avoid: Callable[[str, Capability], str | None], draft: _Draft
) -> Choice:
    """kvCache.attentionBackend: refused where vLLM would not start it, warned about where it is known to answer
    wrongly, else taken as asked."""
    name = spec.kv_cache.attention_backend
    assert name is not None
    capabilities, where = pool(gpu.generation, gpu.compute_capability, gpu.pool_capabilities)
    backend = BACKENDS.get(name)
    if backend is not None:
        if backend.mla != mla or not all(backend.runs_fp8_on(c) for c in capabilities):
            return Choice(None, f"kvCache.attentionBackend {name} serves no FP8 KV cache on {where}: {backend.reason}")
        if not backend.supports_head_size(spec.model.head_dim):
            return Choice(
                None, f"kvCache.attentionBackend {name}: {backend.reason}, not head_dim {spec.model.head_dim}"
            )
    else:
        draft.say(
            PlanCode.ATTENTION_BACKEND_REQUESTED,
            f"kvCache.attentionBackend {name} is not in the backend table: where it serves FP8 KV is not checked",
            Severity.WARNING,
        )
    bad = next((why for c in capabilities if (why := avoid(name, c)) is not None), None)
    if bad is not None:
        draft.say(
            PlanCode.KNOWN_BAD_COMBINATION,
            f"kvCache.attentionBackend {name} is taken as asked, but {bad}",
            Severity.WARNING,
        )
    elif backend is not None:
        draft.say(
            PlanCode.ATTENTION_BACKEND_REQUESTED, f"kvCache.attentionBackend {name} runs an FP8 KV cache on {where}"
        )
    return Choice(name, f"kvCache.attentionBackend {name}")


def _skip_layers(spec: KVPolicySpec, draft: _Draft) -> list[str]:
    window = spec.model.sliding_window
    choice = spec.kv_cache.skip_sliding_window_layers
    if window is None or choice == SkipSlidingWindowLayers.NEVER:
        return []
    share = window.layer_count / spec.model.num_layers
    if choice == SkipSlidingWindowLayers.ALWAYS:
        draft.say(
            PlanCode.SKIP_SLIDING_WINDOW_LAYERS,
            "sliding-window layers stay BF16 (kvCache.skipSlidingWindowLayers Always)",
        )
        return ["sliding_window"]
    if share >= SKIP_SW_MIN_LAYER_SHARE and window.window_tokens <= SKIP_SW_MAX_WINDOW_TOKENS:
        draft.say(
            PlanCode.SKIP_SLIDING_WINDOW_LAYERS,
            f"{window.layer_count} of {spec.model.num_layers} layers use a {window.window_tokens}-token window: "
            "their KV is small, so they stay BF16 (--kv-cache-dtype-skip-layers sliding_window)",
        )
        return ["sliding_window"]
    draft.say(PlanCode.SLIDING_WINDOW_LAYERS_FP8, "sliding-window layers are few or wide: they use FP8 like the rest")
    return []


def plan(spec: KVPolicySpec, gpu: GpuFacts) -> Plan:
    draft = _rules(spec, gpu)
    requested = spec.kv_cache.dtype
    if requested == KVCacheDtype.BF16:
        if draft.fp8:
            draft.say(
                PlanCode.BF16_REQUESTED,
                "kvCache.dtype BF16 is honoured, though the rules would plan FP8",
                Severity.WARNING,
            )
        else:
            draft.say(PlanCode.BF16_REQUESTED, "kvCache.dtype BF16 is honoured")
        draft.fp8 = False
    elif requested == KVCacheDtype.FP8 and not draft.fp8:
        if draft.hard_refusal:
            draft.say(
                PlanCode.FP8_REFUSED, "kvCache.dtype FP8 is refused: a safety rule above forbids it", Severity.WARNING
            )
        else:
            draft.say(PlanCode.FP8_REQUESTED, "kvCache.dtype FP8 is honoured against the rules above", Severity.WARNING)
            draft.fp8 = True

    if not draft.fp8:
        draft.say(PlanCode.HOLD_BF16, "the target keeps its BF16 KV cache; no canary is started")
        return Plan(
            kv_cache_dtype=KVCacheDtype.BF16,
            vllm_kv_cache_dtype="auto",
            image=spec.images.baseline,
            reasons=draft.reasons,
        )

    if spec.kv_cache.scales == KVScales.CALIBRATED:
        draft.say(PlanCode.CALIBRATED_SCALES, f"calibrated per-head KV scales from {spec.kv_cache.scales_source}")
    else:
        draft.say(
            PlanCode.UNCALIBRATED_SCALES,
            "FP8 scales are 1.0 (uncalibrated): the accuracy gate must show recovery >= minRecovery, else calibrate",
        )
    skip = _skip_layers(spec, draft)
    backend = draft.backend
    if backend is None:  # pragma: no cover - an FP8 plan always passed the backend rule
        raise RuntimeError("FP8 planned without an attention backend")
    args = ["--kv-cache-dtype", "fp8"]
    if skip:
        args += ["--kv-cache-dtype-skip-layers", *skip]
    args += ["--attention-backend", backend]
    # Only a truncating GPU needs another image; elsewhere the canary runs the target's own image, whatever it is
    # now (a hand-made hotfix included), so the gates compare the KV cache alone and promotion changes nothing else.
    image = spec.images.fp8_patched if gpu.generation in TRUNCATING_ACCUMULATORS else None

    gates = []
    preflight = ""
    if spec.gates.gpu_preflight.enabled and gpu.generation in TRUNCATING_ACCUMULATORS:
        gates.append(GATE_PREFLIGHT)
        if backend not in PROBE_BACKENDS:
            preflight = f" ({GATE_PREFLIGHT} cannot measure {backend}: it will report PreflightNotProbed)"
    if spec.gates.accuracy.enabled:
        gates.append(GATE_ACCURACY)
    else:
        draft.say(
            PlanCode.ACCURACY_GATE_DISABLED,
            "gates.accuracy is disabled: an FP8 numerics error would reach users as fluent wrong answers",
            Severity.WARNING,
        )
    if spec.gates.latency.enabled:
        gates.append(GATE_LATENCY)
    gated = ", ".join(gates) or "nothing"
    draft.say(PlanCode.CANARY_FP8, f"canary runs FP8 KV ({' '.join(args)}), gated by {gated}{preflight}")
    return Plan(
        kv_cache_dtype=KVCacheDtype.FP8,
        vllm_kv_cache_dtype="fp8",
        skip_layers=skip,
        image=image,
        attention_backend=backend,
        extra_args=args,
        gates=gates,
        reasons=draft.reasons,
    )


def bf16_cause(plan_: Plan) -> PlanReason:
    """Why a plan holds BF16: its most specific cause (BF16_CAUSES order), else its last reason."""
    by_code = {reason.code: reason for reason in plan_.reasons}
    for code in BF16_CAUSES:
        if code in by_code:
            return by_code[code]
    if plan_.reasons:
        return plan_.reasons[-1]
    return PlanReason(code=PlanCode.HOLD_BF16, message="the plan keeps BF16")
