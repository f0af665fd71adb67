"""KVPolicy v1alpha1: the pydantic models are the single source of truth for the CRD (see `kvpolicy.api.crd`).

Conventions (Kubernetes API): camelCase fields, spec/status split, no floats in spec (ratios are decimal strings),
durations as integer `...Seconds`, `metav1.Condition`s in status. Each cross-field rule is declared once as a `Rule`:
the CRD carries it as a CEL `x-kubernetes-validations` entry and pydantic enforces the same check offline, with the
same message, so `kvpolicy plan -f` rejects exactly what the API server would. Spec types are as strict as the API
server's: `headDim: "128"` or `enabled: "true"` are refused, not coerced, and integers must fit in 64 bits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

GROUP = "kvpolicy.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVPolicy"
PLURAL = "kvpolicies"
SINGULAR = "kvpolicy"
SHORT_NAMES = ("kvp",)

# A gate asks for a short answer after its prompt: both must fit in the model's length.
ANSWER_HEADROOM_TOKENS = 128

DECIMAL_PATTERN = r"^[0-9]+(\.[0-9]+)?$"
_DECIMAL_RE = re.compile(DECIMAL_PATTERN)
# Upper bounds a real deployment stays far inside; each field's description says its own. They keep absurd values
# (1e15 seconds, a million canary replicas) out at admission, keep the operator's time arithmetic finite, and keep
# every integer far inside the int64 the API server stores.
MAX_TOKENS = 16_777_216  # 2^24: ten times the longest context served today (10M tokens)
MAX_DURATION_SECONDS = 604_800  # one week
MAX_CANARY_REPLICAS = 64
# The accuracy gate's length profile: at most this many buckets, each at least this long (a shorter one holds the
# needles and the question with little haystack around them).
MAX_PROFILE_BUCKETS = 6
MIN_PROFILE_BUCKET_TOKENS = 1024
MAX_RATIO = 100  # latency ratios: a canary 100x slower than its baseline is beyond any useful limit
DECIMAL_MAX_LENGTH = 24
# metadata.name of a custom resource: a DNS-1123 subdomain, as the API server validates it.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
NAME_MAX_LENGTH = 253
# metadata.namespace: a DNS-1123 label.
NAMESPACE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A vLLM release ("0.32.0", "v0.32.1") with an optional pre-release or local suffix ("0.33.0rc1", "0.32.0+cu130").
VLLM_VERSION_PATTERN = r"^v?[0-9]{1,4}[.][0-9]{1,4}([.][0-9]{1,4})?([.+-]?[0-9A-Za-z][0-9A-Za-z.+-]*)?$"
NAMESPACE_MAX_LENGTH = 63

# Spec types without pydantic's lax coercion: "128" is not an integer and "true" is not a boolean to the API server.
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]


@dataclass(frozen=True)
class Rule:
    """A cross-field validation rule: `cel` for the API server, `check` for offline validation, one `message`.

    `values` and `values_cel` render the offending values (e.g. "262144 > 131072") the same way in Python and in CEL:
    the CRD appends them to the message through a `messageExpression`, pydantic through `failure`.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    values: Callable[[Any], str] | None = None
    values_cel: str = ""

    def failure(self, model: Any) -> str:
        return f"{self.message} ({self.values(model)})" if self.values is not None else self.message

    @property
    def message_expression(self) -> str | None:
        """The CEL expression the API server evaluates for the message of a failed rule (None: `message` alone)."""
        if not self.values_cel:
            return None
        return f"'{self.message} (' + {self.values_cel} + ')'"


def _quoted(value: str) -> str:
    """A string value as the messages show it, "like this" (the CEL side writes '"' + value + '"')."""
    return f'"{value}"'


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )
    # Rules declared by subclasses; collected into the CRD by kvpolicy.api.crd.
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.failure(self))
        return self

    def to_k8s(self) -> dict[str, Any]:
        """The object as the API stores it: camelCase keys, enums as strings, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def decimal_string(description: str, default: str) -> Any:
    return Field(default=default, pattern=DECIMAL_PATTERN, max_length=DECIMAL_MAX_LENGTH, description=description)


def parse_decimal(value: str) -> float:
    """Parse a spec ratio string ("0.95"); the schema's pattern has already rejected anything else."""
    if not _DECIMAL_RE.match(value):
        raise ValueError(f"{value!r} is not a decimal number such as 0.95")
    try:
        return float(Decimal(value))
    except InvalidOperation as err:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"{value!r} is not a decimal number such as 0.95") from err


def _positive(value: str) -> bool:
    return _DECIMAL_RE.match(value) is not None and Decimal(value) > 0


def _quantile(value: str) -> bool:
    return _positive(value) and Decimal(value) < 1


def _latency_ratio(value: str) -> bool:
    return _positive(value) and Decimal(value) <= MAX_RATIO


# ---------------------------------------------------------------------------------------------------------- enums


class KVCacheDtype(StrEnum):
    AUTO = "Auto"
    FP8 = "FP8"
    BF16 = "BF16"


class SkipSlidingWindowLayers(StrEnum):
    AUTO = "Auto"
    ALWAYS = "Always"
    NEVER = "Never"


class KVScales(StrEnum):
    UNCALIBRATED = "Uncalibrated"
    CALIBRATED = "Calibrated"


class AttentionKind(StrEnum):
    MHA = "MHA"
    GQA = "GQA"
    MLA = "MLA"


class ImageFeature(StrEnum):
    TWO_LEVEL_ACCUMULATION = "TwoLevelAccumulation"
    FAST_HEAD_DIM_256 = "FastHeadDim256"


class LatencyProvider(StrEnum):
    PROMETHEUS = "Prometheus"
    SCRAPE = "Scrape"


class OnInconclusive(StrEnum):
    HOLD = "Hold"
    ROLLBACK = "Rollback"


class OnSystematicShift(StrEnum):
    """What the accuracy gate's length profile does with a canary below the baseline at every length (Flagger and
    Argo Rollouts let users choose what an analysis finding does; so does this)."""

    WARN = "Warn"
    FAIL = "Fail"


class AccuracyTask(StrEnum):
    """The accuracy gate's task (gate_programs/tasks.py). `multikey` and `multiquery` are this project's RULER-style
    mix (8 word-key needles in the filler haystack, asked one per request or all at once); the `niah_*` ones are
    RULER's own (NVIDIA/RULER scripts/synthetic.yaml: its templates, answer prefix and string_match_all)."""

    MULTIKEY = "multikey"
    MULTIQUERY = "multiquery"
    NIAH_SINGLE_1 = "niah_single_1"
    NIAH_MULTIKEY_2 = "niah_multikey_2"
    NIAH_MULTIKEY_3 = "niah_multikey_3"
    NIAH_MULTIVALUE = "niah_multivalue"
    NIAH_MULTIQUERY = "niah_multiquery"
    MRCR = "mrcr"


class PromptFormat(StrEnum):
    """How the accuracy gate sends its prompts (gate_programs/accuracy.py)."""

    AUTO = "Auto"
    CHAT = "Chat"
    COMPLETION = "Completion"


class Traffic(StrEnum):
    REPLICA_RATIO = "ReplicaRatio"
    SYNTHETIC = "Synthetic"
    INFERENCE_POOL = "InferencePool"


class Approval(StrEnum):
    AUTOMATIC = "Automatic"
    MANUAL = "Manual"


class OnDrift(StrEnum):
    """What a decided policy does when its target stops running what was decided."""

    REEVALUATE = "Reevaluate"
    REPORT = "Report"


class ApplyMode(StrEnum):
    """Patch: the operator writes the target. Advisory: it never does; it publishes the change for a GitOps
    repository to take."""

    PATCH = "Patch"
    ADVISORY = "Advisory"


class WebhookFormat(StrEnum):
    CLOUD_EVENTS = "CloudEvents"
    SLACK = "Slack"
    TEAMS = "Teams"


class NotificationEvent(StrEnum):
    """What a receiver is sent: every phase change, decisions, drift of the target."""

    PHASE_CHANGED = "PhaseChanged"
    DECIDED = "Decided"
    DRIFTED = "Drifted"


class Phase(StrEnum):
    """status.phase: Planning -> HeldBF16 | CanaryStarting -> [GpuPreflight] -> [AccuracyGate] -> LatencyAnalysis
    -> [AwaitingApproval] -> Promoting -> Promoted, and from anywhere before the promotion: RollingBack ->
    RolledBack."""

    PLANNING = "Planning"
    HELD_BF16 = "HeldBF16"
    CANARY_STARTING = "CanaryStarting"
    GPU_PREFLIGHT = "GpuPreflight"
    ACCURACY_GATE = "AccuracyGate"
    LATENCY_ANALYSIS = "LatencyAnalysis"
    AWAITING_APPROVAL = "AwaitingApproval"
    PROMOTING = "Promoting"
    PROMOTED = "Promoted"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"


TERMINAL_PHASES = frozenset({Phase.HELD_BF16, Phase.PROMOTED, Phase.ROLLED_BACK})

# The phases a gate Job holds the rollout in, in the order they run (between CanaryStarting and LatencyAnalysis):
# each has one gate in rollout/gates/, which the registry orders by this tuple. A new gate of its own phase adds its
# Phase here, with its condition type, spec and status fields (tests/rollout/test_rollout_gate_registry.py).
GATE_PHASES = (Phase.GPU_PREFLIGHT, Phase.ACCURACY_GATE)


class AnalysisPhase(StrEnum):
    """The one verdict every gate comes to, Job gate and metrics check alike (after Argo Rollouts' AnalysisPhase): the
    step, the analysis and `kubectl kvpolicy` decide by it. Status keeps each gate's own word for it (`GateVerdict`)."""

    RUNNING = "Running"
    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"  # measured, but the evidence cannot tell
    ERROR = "Error"  # could not measure: the Job ended without a verdict, the metrics provider could not answer

    @property
    def conclusive(self) -> bool:
        return self in (AnalysisPhase.SUCCESSFUL, AnalysisPhase.FAILED)


class GateVerdict(StrEnum):
    """What a gate said, in its own word, as status shows it: a gate Job's report (Pass/Fail/Inconclusive for the
    accuracy gate, Safe/Unsafe for the GPU preflight, Pass/Breach for the latency probe; Error: it ended without one;
    Running while it runs), or a metrics check (Pass, Breach, NoData, ProviderUnavailable). `phase` is what it means."""

    RUNNING = "Running"
    PASS = "Pass"
    FAIL = "Fail"
    BREACH = "Breach"
    SAFE = "Safe"
    UNSAFE = "Unsafe"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"
    NO_DATA = "NoData"
    PROVIDER_UNAVAILABLE = "ProviderUnavailable"

    @property
    def phase(self) -> AnalysisPhase:
        return _VERDICT_PHASES[self]

    @property
    def conclusive(self) -> bool:
        return self.phase.conclusive


# The words a metrics check says (status.latency.last.verdict), and those a gate Job's record says.
CHECK_VERDICTS = (GateVerdict.PASS, GateVerdict.BREACH, GateVerdict.NO_DATA, GateVerdict.PROVIDER_UNAVAILABLE)
JOB_VERDICTS = tuple(v for v in GateVerdict if v not in (GateVerdict.NO_DATA, GateVerdict.PROVIDER_UNAVAILABLE))


def _only(allowed: tuple[GateVerdict, ...]) -> BeforeValidator:
    """Admit only these words (the field's CRD enum says the same)."""
    quoted = [f"'{verdict.value}'" for verdict in allowed]
    expected = f"{', '.join(quoted[:-1])} or {quoted[-1]}"

    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"Input should be {expected}")
        return value

    return BeforeValidator(check)


CheckVerdictWord = Annotated[
    GateVerdict, _only(CHECK_VERDICTS), Field(json_schema_extra={"enum": [v.value for v in CHECK_VERDICTS]})
]
JobVerdictWord = Annotated[
    GateVerdict, _only(JOB_VERDICTS), Field(json_schema_extra={"enum": [v.value for v in JOB_VERDICTS]})
]

_VERDICT_PHASES = {
    GateVerdict.RUNNING: AnalysisPhase.RUNNING,
    GateVerdict.PASS: AnalysisPhase.SUCCESSFUL,
    GateVerdict.SAFE: AnalysisPhase.SUCCESSFUL,
    GateVerdict.FAIL: AnalysisPhase.FAILED,
    GateVerdict.BREACH: AnalysisPhase.FAILED,
    GateVerdict.UNSAFE: AnalysisPhase.FAILED,
    GateVerdict.INCONCLUSIVE: AnalysisPhase.INCONCLUSIVE,
    GateVerdict.NO_DATA: AnalysisPhase.INCONCLUSIVE,
    GateVerdict.ERROR: AnalysisPhase.ERROR,
    GateVerdict.PROVIDER_UNAVAILABLE: AnalysisPhase.ERROR,
}


class DecisionResult(StrEnum):
    PROMOTED = "Promoted"
    ROLLED_BACK = "RolledBack"
    HELD_BF16 = "HeldBF16"


class ConditionType(StrEnum):
    # Whether the operator can act on the policy: False for an invalid spec, a target another policy governs, or a
    # request the API server refused.
    READY = "Ready"
    PLANNED = "Planned"
    CANARY_READY = "CanaryReady"
    CAPACITY_AVAILABLE = "CapacityAvailable"
    CANARY_CONFIG_VERIFIED = "CanaryConfigVerified"
    PREFLIGHT_PASSED = "PreflightPassed"
    ACCURACY_GATE_PASSED = "AccuracyGatePassed"
    LATENCY_GATE_PASSED = "LatencyGatePassed"
    PROMOTED = "Promoted"
    ROLLED_BACK = "RolledBack"
    PAUSED = "Paused"
    DRIFTED = "Drifted"
    TRAFFIC_ROUTED = "TrafficRouted"  # traffic InferencePool: the route sends the canary the current step's share
    # traffic ReplicaRatio: False when an InferencePool's endpoint picker, not the replica count, will set the share.
    REPLICA_RATIO_HOLDS = "ReplicaRatioHolds"
    # ReplicaRatio and InferencePool: the canary's measured share of the requests is near the share it was meant to get.
    TRAFFIC_SHARE_AS_INTENDED = "TrafficShareAsIntended"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


# ----------------------------------------------------------------------------------------------------------- spec


class TargetKind(StrEnum):
    """The kinds of serving workload a policy can govern; each has its implementation in `rollout/targets/`."""

    DEPLOYMENT = "Deployment"
    LEADER_WORKER_SET = "LeaderWorkerSet"
    LLM_INFERENCE_SERVICE = "LLMInferenceService"


# The apiVersion each target kind is served at.
TARGET_API_VERSIONS: dict[TargetKind, str] = {
    TargetKind.DEPLOYMENT: "apps/v1",
    TargetKind.LEADER_WORKER_SET: "leaderworkerset.x-k8s.io/v1",
    TargetKind.LLM_INFERENCE_SERVICE: "serving.kserve.io/v1alpha2",
}


def _target_api_versions_cel() -> str:
    return " || ".join(
        f"(self.kind == '{kind.value}' && self.apiVersion == '{version}')"
        for kind, version in TARGET_API_VERSIONS.items()
    )


class TargetRef(_Model):
    """The existing vLLM workload the policy governs (like Flagger's targetRef)."""

    rules = (
        Rule(
            cel=_target_api_versions_cel(),
            message="targetRef.apiVersion must be the kind's: "
            + ", ".join(f"{kind.value} is {version}" for kind, version in TARGET_API_VERSIONS.items()),
            check=lambda m: TARGET_API_VERSIONS[m.kind] == m.api_version,
            values=lambda m: f"{m.kind.value} {m.api_version}",
            values_cel="self.kind + ' ' + self.apiVersion",
        ),
    )

    api_version: str = Field(
        default="apps/v1",
        max_length=253,
        description="The kind's API group and version: apps/v1 for a Deployment, leaderworkerset.x-k8s.io/v1 for "
        "a LeaderWorkerSet, serving.kserve.io/v1alpha2 for an LLMInferenceService.",
    )
    kind: TargetKind = Field(
        default=TargetKind.DEPLOYMENT,
        description="The kind of workload that serves the model: a Deployment; a LeaderWorkerSet (multi-host vLLM: "
        "the leader's container is the target's, the workers' KV flags follow it); or a KServe LLMInferenceService "
        "(its spec.template's container; the canary joins its routing group).",
    )
    name: str = Field(min_length=1, max_length=253, description="Name of the workload in the policy's namespace.")
    container: str | None = Field(
        default=None,
        description="The vLLM container in the pod template (a LeaderWorkerSet's leader template); defaults to the "
        "first container.",
    )


class SlidingWindow(_Model):
    """Sliding-window attention layers: give their indices, or their count."""

    rules = (
        Rule(
            cel="has(self.layers) != has(self.count)",
            message="set exactly one of slidingWindow.layers (indices) or slidingWindow.count",
            check=lambda m: (m.layers is None) != (m.count is None),
        ),
    )

    layers: list[Annotated[Int, Field(ge=0, le=1023)]] | None = Field(
        default=None, max_length=1024, description="Indices of the sliding-window layers."
    )
    count: Int | None = Field(default=None, ge=1, le=1024, description="Number of sliding-window layers.")
    window_tokens: Int = Field(ge=1, le=MAX_TOKENS, description="Window size in tokens (at most 2^24).")

    @property
    def layer_count(self) -> int:
        return len(self.layers) if self.layers is not None else (self.count or 0)


class ModelSpec(_Model):
    """Facts about the served model that the planner needs."""

    served_model_name: str = Field(
        min_length=1, max_length=256, description="Name the server answers to (--served-model-name)."
    )
    head_dim: Int = Field(ge=16, le=1024, description="Attention head dimension (64, 128, 256, ...).")
    num_layers: Int = Field(ge=1, le=1024, description="Number of attention layers.")
    attention: AttentionKind = Field(default=AttentionKind.GQA, description="MHA, GQA or MLA.")
    max_model_len: Int = Field(
        ge=1, le=MAX_TOKENS, description="Maximum model length in tokens (--max-model-len); at most 2^24."
    )
    sliding_window: SlidingWindow | None = Field(default=None, description="Sliding-window layers, if any.")


class WorkloadSpec(_Model):
    """What the workload sends; the accuracy gate runs at maxContextTokens."""

    rules = (
        Rule(
            cel="!has(self.typicalContextTokens) || self.typicalContextTokens <= self.maxContextTokens",
            message="workload.typicalContextTokens must not exceed workload.maxContextTokens",
            check=lambda m: m.typical_context_tokens is None or m.typical_context_tokens <= m.max_context_tokens,
            values=lambda m: f"{m.typical_context_tokens} > {m.max_context_tokens}",
            values_cel="string(self.typicalContextTokens) + ' > ' + string(self.maxContextTokens)",
        ),
    )

    max_context_tokens: Int = Field(
        ge=1, le=MAX_TOKENS, description="Longest prompt the workload sends, in tokens (at most 2^24)."
    )
    typical_context_tokens: Int | None = Field(
        default=None, ge=1, le=MAX_TOKENS, description="Typical prompt length; defaults to maxContextTokens."
    )
    prefill_latency_critical: Bool = Field(
        default=False, description="Time to first token matters more than decode speed (e.g. a TTFT objective)."
    )
    decode_break_even_tokens: Int | None = Field(
        default=None,
        ge=1,
        le=MAX_TOKENS,
        description="Context length above which FP8 decodes faster on your setup; defaults to the published figure "
        "for the GPU generation.",
    )

    @property
    def typical_tokens(self) -> int:
        return self.typical_context_tokens or self.max_context_tokens


class KVCacheSpec(_Model):
    """KV cache dtype policy and FP8 scales."""

    rules = (
        Rule(
            cel="self.scales != 'Calibrated' || has(self.scalesSource)",
            message="kvCache.scalesSource is required when kvCache.scales is Calibrated",
            check=lambda m: m.scales != KVScales.CALIBRATED or m.scales_source is not None,
        ),
    )

    dtype: KVCacheDtype = Field(
        default=KVCacheDtype.AUTO, description="Auto lets the planner decide; FP8 or BF16 force."
    )
    skip_sliding_window_layers: SkipSlidingWindowLayers = Field(
        default=SkipSlidingWindowLayers.AUTO,
        description="Keep sliding-window layers in BF16 (--kv-cache-dtype-skip-layers sliding_window).",
    )
    attention_backend: str | None = Field(
        default=None,
        max_length=64,
        pattern=r"^[A-Z][A-Z0-9_]*$",
        description="The --attention-backend the canary's FP8 KV cache runs on (FLASH_ATTN, TRITON_ATTN, FLASHINFER, "
        "...), instead of the planner's choice; a combination known to answer wrongly is planned with a warning.",
    )
    scales: KVScales = Field(default=KVScales.UNCALIBRATED, description="Uncalibrated uses scale 1.0.")
    scales_source: str | None = Field(
        default=None,
        min_length=1,
        description="Where calibrated per-head KV scales come from (an LLM-Compressor checkpoint reference).",
    )


class ImagesSpec(_Model):
    """Serving images: the BF16 baseline and the patched FP8-attention image."""

    baseline: str | None = Field(
        default=None, min_length=1, description="BF16 serving image; defaults to the target's current image."
    )
    fp8_patched: str | None = Field(
        default=None,
        min_length=1,
        description="Serving image whose FP8 attention uses two-level accumulation (needed on Hopper).",
    )
    fp8_patched_features: list[ImageFeature] = Field(
        default=[ImageFeature.TWO_LEVEL_ACCUMULATION],
        max_length=8,
        description="What the patched image declares: TwoLevelAccumulation, FastHeadDim256.",
    )
    vllm_version: str | None = Field(
        default=None,
        max_length=64,
        pattern=VLLM_VERSION_PATTERN,
        description="The vLLM version the canary's image runs (0.32.0, v0.32.1, 0.33.0rc1), for planning before "
        "anything runs: the planner's version table says which flags and attention backends it may use. Unset: the "
        "planner avoids every known-bad combination and says which table it used.",
    )


class LengthProfile(_Model):
    """Sample shorter lengths beside the gate's own, to see a shift that one length hides."""

    buckets: Int = Field(
        default=1,
        ge=1,
        le=MAX_PROFILE_BUCKETS,
        description="Context-length buckets the gate samples: its length halved buckets - 1 times up to its length "
        "(4: length/8, /4, /2 and the length itself), each answering the same prompts, one per bucket per round. The "
        "decision stays the sequential one at the gate's length, after as many of its prompts as without a profile; "
        "the shorter buckets add their prompts beside them (4 buckets: 1.875x the prompt tokens). 1: the gate's "
        "length alone. The gate reports each bucket's scores, an AUC across them, and a systematic shift: the canary "
        "below the baseline in every bucket, shown by a sign test on the paired needles. The shortest bucket must be "
        f"at least {MIN_PROFILE_BUCKET_TOKENS} tokens.",
    )
    on_systematic_shift: OnSystematicShift = Field(
        default=OnSystematicShift.WARN,
        description="Warn: a passing gate passes, with a SystematicShift Warning event and the finding in its "
        "condition (calibrate the KV scales). Fail: a systematic shift rolls back (AccuracySystematicShift) even when "
        "the decision at the gate's length passes.",
    )


class AccuracyGate(_Model):
    """Long-context needle-in-a-haystack gate, run as a Job before the canary takes any traffic."""

    rules = (
        Rule(
            cel="double(self.minRecovery) > 0.0 && double(self.minRecovery) <= 1.0",
            message='gates.accuracy.minRecovery must be a number in (0, 1], such as "0.95"',
            check=lambda m: _positive(m.min_recovery) and Decimal(m.min_recovery) <= 1,
            values=lambda m: f"got {_quoted(m.min_recovery)}",
            values_cel="'got \"' + self.minRecovery + '\"'",
        ),
        Rule(
            cel="double(self.confidence) > 0.0 && double(self.confidence) < 1.0",
            message='gates.accuracy.confidence must be a number in (0, 1), such as "0.95"',
            check=lambda m: _positive(m.confidence) and Decimal(m.confidence) < 1,
            values=lambda m: f"got {_quoted(m.confidence)}",
            values_cel="'got \"' + self.confidence + '\"'",
        ),
        Rule(
            cel="self.mrcrNeedles in [2, 4, 8]",
            message="gates.accuracy.mrcrNeedles must be 2, 4 or 8 (MRCR's needle counts)",
            check=lambda m: m.mrcr_needles in (2, 4, 8),
            values=lambda m: f"got {m.mrcr_needles}",
            values_cel="'got ' + string(self.mrcrNeedles)",
        ),
        Rule(
            cel="self.task != 'mrcr' || self.promptFormat != 'Completion'",
            message="gates.accuracy.task mrcr is a conversation: set promptFormat Chat or Auto",
            check=lambda m: m.task != AccuracyTask.MRCR or m.prompt_format != PromptFormat.COMPLETION,
        ),
        Rule(
            cel="double(self.baselineFloor) < 1.0",
            message='gates.accuracy.baselineFloor must be a number in [0, 1), such as "0.2"',
            check=lambda m: _DECIMAL_RE.match(m.baseline_floor) is not None and Decimal(m.baseline_floor) < 1,
            values=lambda m: f"got {_quoted(m.baseline_floor)}",
            values_cel="'got \"' + self.baselineFloor + '\"'",
        ),
    )

    enabled: Bool = Field(default=True, description="Run the long-context accuracy gate before any traffic.")
    task: AccuracyTask = Field(
        default=AccuracyTask.MULTIKEY,
        description="What the prompts ask. multikey (default): 8 needles in RULER's filler haystack, each asked in a "
        "request of its own over the shared haystack (one long prefill scores 8 needles; fewest prompts per decision, "
        "BENCHMARKS.md); multiquery: the same 8 asked in one question. RULER's own tasks, with its templates, answer "
        "prefix and string_match_all: niah_single_1 (one word key, number value, repeated filler), niah_multikey_2 "
        "(a haystack of distractor needles), niah_multikey_3 (UUID keys and values among UUID distractors), "
        "niah_multivalue (4 values of one key) and niah_multiquery (4 keys asked at once); RULER draws the last two's "
        "haystack from essays, which cannot be shipped here: they use the repeated filler. mrcr: MRCR's format and "
        "score (openai/mrcr, the vLLM FP8 KV blog's benchmark) on conversations generated here by seed, not its "
        "dataset: mrcrNeedles identical asks among distractor turns, the last turn asking for the i-th answer; a chat, "
        "so it needs promptFormat Chat or Auto.",
    )
    mrcr_needles: Int = Field(
        default=2, ge=2, le=8, description="mrcr: identical asks hidden in each conversation, 2, 4 or 8 (MRCR's)."
    )
    prompt_format: PromptFormat = Field(
        default=PromptFormat.COMPLETION,
        description="Completion (default): prompts as token ids to /v1/completions, each exactly lengthTokens long. "
        "Chat: messages to /v1/chat/completions through the served model's chat template (chat_template_kwargs "
        "enable_thinking false; a leading </think>-terminated block is stripped before scoring), each sized by "
        "/tokenize with the messages and add_generation_prompt to the longest whole-word haystack within "
        "lengthTokens. Auto: Chat when the served model has a chat template (vLLM's /tokenize accepts messages), "
        "else Completion. The default stays Completion: the prompts-per-decision figures in BENCHMARKS.md are "
        "measured with it.",
    )
    length_tokens: Int | None = Field(
        default=None,
        ge=1,
        le=MAX_TOKENS,
        description="Prompt length for the gate; defaults to workload.maxContextTokens.",
    )
    min_recovery: str = decimal_string('Minimum canary/baseline NIAH score ratio, e.g. "0.95".', "0.95")
    max_samples: Int = Field(default=100, ge=1, le=10000, description="Hard cap on prompts per side.")
    confidence: str = decimal_string(
        "Confidence of each decision: a pass (recovery shown above minRecovery) or a fail (shown below) is wrong with "
        "probability at most 1 - confidence however early the gate stops (sequential tests by betting on the paired "
        "needles, needles taken as independent). An A/A run with identical answers passes once 65 needles are right "
        'on both sides at "0.95" (100 at "0.99").',
        "0.95",
    )
    baseline_floor: str = decimal_string(
        "Lowest baseline score (share of needles the BF16 baseline retrieves at the gate's length) the gate judges "
        "by: a baseline shown to score below it, or still below it at maxSamples, makes the gate Inconclusive "
        "(BaselineTooWeak: pick an easier task or a shorter length), never a pass or a fail. At 0.2 an A/A "
        "run with identical answers passes within 100 prompts (8 needles asked) in 500 of 500 simulated runs, after "
        "41 on average; at 0.1 it takes 81 and misses the cap in 4% (bench/accuracy_gate_efficiency.py --floor-scan).",
        "0.2",
    )
    timeout_seconds: Int = Field(
        default=3600, ge=1, le=MAX_DURATION_SECONDS, description="Deadline for the gate Job (at most a week)."
    )
    baseline_requests_per_minute: Int | None = Field(
        default=None,
        ge=1,
        le=60_000,
        description="Most prompts a minute the gate sends to the production pods behind the baseline Service, evenly "
        "spaced (each is a full-length prompt, lengthTokens long: a prefill of the workload's longest context on a "
        "pod serving users). Unset: no limit (each sample's questions go out together). A limit makes the gate take "
        "at least (prompts sent / this) minutes: keep timeoutSeconds above it (the default gate asks 8 questions per "
        "sample, up to maxSamples samples).",
    )
    length_profile: LengthProfile = Field(
        default_factory=LengthProfile, description="Shorter lengths sampled beside the gate's own (off: 1 bucket)."
    )


class LatencyGate(_Model):
    """Canary vs baseline TTFT/ITL analysis over the bake window."""

    rules = (
        Rule(
            cel="double(self.ttftMaxRatio) > 0.0 && double(self.itlMaxRatio) > 0.0 "
            f"&& double(self.ttftMaxRatio) <= {MAX_RATIO}.0 && double(self.itlMaxRatio) <= {MAX_RATIO}.0",
            message=f'gates.latency.ttftMaxRatio and itlMaxRatio must be numbers in (0, {MAX_RATIO}], such as "1.10"',
            check=lambda m: _latency_ratio(m.ttft_max_ratio) and _latency_ratio(m.itl_max_ratio),
            values=lambda m: f"got {_quoted(m.ttft_max_ratio)} and {_quoted(m.itl_max_ratio)}",
            values_cel="'got \"' + self.ttftMaxRatio + '\" and \"' + self.itlMaxRatio + '\"'",
        ),
        Rule(
            cel="self.provider != 'Prometheus' || has(self.prometheusURL)",
            message="gates.latency.prometheusURL is required when provider is Prometheus",
            check=lambda m: m.provider != LatencyProvider.PROMETHEUS or m.prometheus_url is not None,
        ),
        Rule(
            cel="!has(self.prometheusAuth) || !has(self.prometheusAuth.tls) || (has(self.prometheusURL) "
            "&& self.prometheusURL.startsWith('https://'))",
            message="gates.latency.prometheusAuth.tls needs an https:// prometheusURL",
            check=lambda m: (
                m.prometheus_auth is None
                or m.prometheus_auth.tls is None
                or (m.prometheus_url or "").startswith("https://")
            ),
        ),
        Rule(
            cel="self.quantiles.all(q, double(q) > 0.0 && double(q) < 1.0)",
            message='gates.latency.quantiles must be numbers in (0, 1), such as "0.95"',
            check=lambda m: all(_quantile(q) for q in m.quantiles),
            values=lambda m: f"got {_quoted(next(q for q in m.quantiles if not _quantile(q)))}",
            values_cel="'got \"' + self.quantiles.filter(q, !(double(q) > 0.0 && double(q) < 1.0))[0] + '\"'",
        ),
    )

    enabled: Bool = Field(default=True, description="Compare canary and baseline TTFT/ITL before promoting.")
    provider: LatencyProvider = Field(
        default=LatencyProvider.SCRAPE,
        description="Prometheus (PromQL over prometheusURL) or Scrape (the pods' /metrics directly).",
    )
    prometheus_url: str | None = Field(
        default=None, alias="prometheusURL", pattern=r"^https?://", description="Prometheus base URL."
    )
    prometheus_auth: PrometheusAuth | None = Field(
        default=None, description="Credentials, headers and TLS for prometheusURL, from Secrets and ConfigMaps."
    )
    ttft_max_ratio: str = decimal_string("Largest allowed canary/baseline TTFT ratio per quantile.", "1.10")
    itl_max_ratio: str = decimal_string("Largest allowed canary/baseline ITL ratio per quantile.", "1.05")
    quantiles: list[Annotated[str, Field(pattern=DECIMAL_PATTERN, max_length=DECIMAL_MAX_LENGTH)]] = Field(
        default=["0.5", "0.95"], min_length=1, max_length=8, description="Quantiles compared."
    )
    window_seconds: Int = Field(
        default=300,
        ge=10,
        le=86_400,
        description="Window each check looks back over (at most a day), cut to the time since the canary joined.",
    )
    min_requests: Int = Field(
        default=50, ge=0, le=1_000_000, description="Fewer requests per side in the window = NoData."
    )
    interval_seconds: Int = Field(default=60, ge=1, le=3_600, description="Time between checks (at most an hour).")
    consecutive_failure_limit: Int = Field(default=3, ge=1, le=100, description="Breaches in a row that roll back.")
    on_inconclusive: OnInconclusive = Field(
        default=OnInconclusive.HOLD, description="What NoData/ProviderUnavailable do after the stall deadline."
    )
    inconclusive_deadline_seconds: Int = Field(
        default=1800,
        ge=1,
        le=MAX_DURATION_SECONDS,
        description="How long checks may stay inconclusive before onInconclusive applies (at most a week).",
    )


class GpuPreflightGate(_Model):
    """Accumulation-cliff probe Job on the target GPU pool (Hopper and Ada)."""

    enabled: Bool = Field(default=False, description="Run the accumulation-cliff probe Job on the target GPU pool.")
    image: str | None = Field(default=None, min_length=1, description="Probe image; defaults to the operator's.")


class GatesSpec(_Model):
    """Checks a canary must pass before promotion."""

    accuracy: AccuracyGate = Field(default_factory=AccuracyGate)
    latency: LatencyGate = Field(default_factory=LatencyGate)
    gpu_preflight: GpuPreflightGate = Field(default_factory=GpuPreflightGate)


# The placeholders of a custom check's query, spelled exactly so; every "{{" in a query must start one of them.
CHECK_PLACEHOLDERS = ("canary", "baseline", "window")
# RE2 (CEL) and Python read this alike: character classes instead of backslashes.
CHECK_QUERY_PATTERN = "^([{]?[{][{] (canary|baseline|window) [}][}]|[{][^{]|[^{])*[{]?$"
# The identifiers a selector template may use ($namespace or ${namespace}); `$$` is a literal dollar.
SELECTOR_TEMPLATE_FIELDS = ("namespace", "pod_regex", "labels", "role")
SELECTOR_TEMPLATE_PATTERN = (
    "^([^$]|[$](namespace|pod_regex|labels|role)([^A-Za-z0-9_$]|$)|[$][{](namespace|pod_regex|labels|role)[}]|[$][$])*$"
)
CHECK_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _bounds_ordered(low: str | None, high: str | None) -> bool:
    return (
        low is None
        or high is None
        or not _DECIMAL_RE.match(low)
        or not _DECIMAL_RE.match(high)
        or (Decimal(low) <= Decimal(high))
    )


class Bounds(_Model):
    """An inclusive range of decimal strings (no floats in spec): a value below `min` or above `max` breaches."""

    rules = (
        Rule(
            cel="has(self.min) || has(self.max)",
            message="a custom check's range needs min, max or both",
            check=lambda m: m.min is not None or m.max is not None,
        ),
        Rule(
            cel="!has(self.min) || !has(self.max) || double(self.min) <= double(self.max)",
            message="a custom check's range must have min <= max",
            check=lambda m: _bounds_ordered(m.min, m.max),
            values=lambda m: f"got min {_quoted(m.min)} and max {_quoted(m.max)}",
            values_cel="'got min \"' + self.min + '\" and max \"' + self.max + '\"'",
        ),
    )

    min: str | None = Field(
        default=None,
        pattern=DECIMAL_PATTERN,
        max_length=DECIMAL_MAX_LENGTH,
        description='Lowest value that passes, e.g. "0".',
    )
    max: str | None = Field(
        default=None,
        pattern=DECIMAL_PATTERN,
        max_length=DECIMAL_MAX_LENGTH,
        description='Highest value that passes, e.g. "0.01".',
    )


class CustomCheck(_Model):
    """A named PromQL check beside TTFT/ITL (like Flagger's MetricTemplate, Argo's AnalysisTemplate), evaluated with
    the latency analysis on every check: its query, with `{{ canary }}` standing for the canary's label matchers, must
    return one value; `range` bounds the canary's value, `baselineRatio` the canary/baseline ratio of the same query
    (evaluated again with the baseline's matchers in place of `{{ canary }}`)."""

    rules = (
        Rule(
            cel="self.query.contains('{{ canary }}')",
            message="a custom check's query must contain the {{ canary }} placeholder (the canary's label matchers)",
            check=lambda m: "{{ canary }}" in m.query,
        ),
        Rule(
            cel=f"self.query.matches('{CHECK_QUERY_PATTERN}')",
            message="a custom check's query may use only the placeholders {{ canary }}, {{ baseline }} and "
            "{{ window }}, spelled with one space inside the braces",
            check=lambda m: re.fullmatch(CHECK_QUERY_PATTERN, m.query) is not None,
        ),
        Rule(
            cel="has(self.range) || has(self.baselineRatio)",
            message="a custom check needs range, baselineRatio or both",
            check=lambda m: m.range is not None or m.baseline_ratio is not None,
        ),
    )

    name: str = Field(
        pattern=CHECK_NAME_PATTERN,
        max_length=63,
        description="Names the check in status, events and reasons' messages.",
    )
    query: str = Field(
        min_length=1,
        max_length=4096,
        description="PromQL returning one value; {{ canary }} is replaced by the canary's label matchers (the "
        "baseline's for baselineRatio), {{ baseline }} by the baseline's, {{ window }} by gates.latency.windowSeconds "
        "as a duration (300s).",
    )
    range: Bounds | None = Field(default=None, description="Inclusive bounds on the canary's value.")
    baseline_ratio: Bounds | None = Field(
        default=None, description="Inclusive bounds on canary value / baseline value."
    )


class AnalysisSpec(_Model):
    """How the live latency analysis selects each side's series, and the custom checks it runs beside TTFT/ITL."""

    rules = (
        Rule(
            cel="!has(self.checks) || self.checks.all(c, self.checks.exists_one(d, d.name == c.name))",
            message="analysis.checks must have unique names",
            check=lambda m: len({check.name for check in m.checks}) == len(m.checks),
        ),
        Rule(
            cel=f"!has(self.selectorTemplate) || self.selectorTemplate.matches('{SELECTOR_TEMPLATE_PATTERN}')",
            message="analysis.selectorTemplate may use only $namespace, $pod_regex, $labels and $role ($$ for a "
            "dollar sign)",
            check=lambda m: (
                m.selector_template is None or re.fullmatch(SELECTOR_TEMPLATE_PATTERN, m.selector_template) is not None
            ),
        ),
        Rule(
            cel="!has(self.selectorTemplate) || self.selectorTemplate.contains('pod_regex') "
            "|| self.selectorTemplate.contains('labels')",
            message="analysis.selectorTemplate must tell the canary's pods from the baseline's: use $pod_regex or "
            "$labels",
            check=lambda m: (
                m.selector_template is None or "pod_regex" in m.selector_template or "labels" in m.selector_template
            ),
        ),
    )

    selector_template: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="Prometheus label matchers (without braces) selecting one side's series; default: "
        'namespace="$namespace", pod=~"$pod_regex". $labels expands to the side\'s pod labels as matchers.',
    )
    checks: list[CustomCheck] = Field(
        default_factory=list, max_length=16, description="Custom PromQL checks (provider Prometheus only)."
    )


ROLLOUT_ID_PATTERN = r"^[0-9]+-[0-9a-f]{6}$"


MAX_TRAFFIC_STEPS = 10


class EndpointPicker(StrEnum):
    """What picks the endpoints of the canary's InferencePool."""

    NONE = "None"  # no endpoint picker: the gateway balances the canary's pods itself (GIE v1.6.0 and later)
    COPY_BASELINE = "CopyBaseline"  # a copy of the baseline pool's EPP Deployment and Service, for the canary's pool


class InferencePoolTraffic(_Model):
    """Where the users' traffic reaches the target through the Gateway API Inference Extension: the HTTPRoute whose
    weights the rollout steps, and the InferencePool of the target's pods that the route sends it to."""

    rules = (
        Rule(
            cel="self.steps.all(s, self.steps.exists_one(t, t == s))",
            message="rollout.inferencePool.steps must not repeat a weight",
            check=lambda m: len(set(m.steps)) == len(m.steps),
        ),
    )

    http_route: str = Field(
        pattern=NAME_PATTERN,
        max_length=NAME_MAX_LENGTH,
        description="The HTTPRoute (gateway.networking.k8s.io/v1) in the policy's namespace whose rules send the "
        "users to `pool`. The operator edits only the backendRefs of those rules (a JSON patch testing them first) "
        "and puts them back exactly as they were when the rollout ends.",
    )
    pool: str = Field(
        pattern=NAME_PATTERN,
        max_length=NAME_MAX_LENGTH,
        description="The InferencePool (inference.networking.k8s.io/v1) that selects the target's pods: the "
        "baseline. The canary gets a pool of its own selecting only its pods, with the baseline's target ports.",
    )
    steps: list[Annotated[Int, Field(ge=1, le=99)]] = Field(
        default_factory=lambda: [10, 50],
        min_length=1,
        max_length=MAX_TRAFFIC_STEPS,
        description="The canary's share of the route's traffic in percent at each step, taken in ascending order. "
        "Each step runs the latency analysis for bakeSeconds before the next; after the last the target is promoted.",
    )
    mirror_percent: Int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Before the first step, mirror this percentage of the route's requests to the canary's pool "
        "(an HTTPRoute RequestMirror filter; the users get the baseline's answers) for one analysis and bake. "
        "Unset: no mirror phase. How a gateway mirrors to a pool is implementation-specific.",
    )
    endpoint_picker: EndpointPicker = Field(
        default=EndpointPicker.NONE,
        description="None: the canary's pool has no endpoint picker (endpointPickerRef is optional from GIE v1.6.0; "
        "the gateway balances the canary's pods). CopyBaseline: the operator copies the Deployment behind the "
        "baseline pool's endpointPickerRef Service, with its configuration, under the canary's name (--pool-name "
        "set to the canary's pool), and a Service for it; the route shifts once the copy is ready.",
    )


class RoutingGroupTraffic(_Model):
    """A target in a routing group of its own kind (a KServe LLMInferenceService's `spec.router.route.group`): the
    canary joins the group at weight 1, then takes the share each step names."""

    rules = (
        Rule(
            cel="self.steps.all(s, self.steps.exists_one(t, t == s))",
            message="rollout.routingGroup.steps must not repeat a share",
            check=lambda m: len(set(m.steps)) == len(m.steps),
        ),
    )

    steps: list[Annotated[Int, Field(ge=1, le=99)]] = Field(
        default_factory=lambda: [10, 50],
        min_length=1,
        max_length=MAX_TRAFFIC_STEPS,
        description="The canary's share of the group's traffic in percent at each step, taken in ascending order: "
        "its weight is set so that it gets that share beside the other members' weights, and a step counts once "
        "the target's status.router.group lists the canary at that weight. Each step runs the latency analysis for "
        "bakeSeconds; after the last the target is promoted.",
    )


class RolloutSpec(_Model):
    """How the canary is run, held, approved, aborted, retried, applied, and what a drifted target does."""

    rules = (
        Rule(
            cel="self.traffic != 'InferencePool' || has(self.inferencePool)",
            message="rollout.inferencePool (httpRoute and pool) is required when rollout.traffic is InferencePool",
            check=lambda m: m.traffic != Traffic.INFERENCE_POOL or m.inference_pool is not None,
        ),
    )

    canary_replicas: Int = Field(
        default=1, ge=1, le=MAX_CANARY_REPLICAS, description="Replicas of the canary Deployment (at most 64)."
    )
    progress_deadline_seconds: Int = Field(
        default=1800,
        ge=1,
        le=MAX_DURATION_SECONDS,
        description="A canary not ready by then (e.g. Pending for GPUs) is rolled back (at most a week).",
    )
    bake_seconds: Int = Field(
        default=600,
        ge=0,
        le=MAX_DURATION_SECONDS,
        description="Latency analysis window before promotion (at most a week).",
    )
    traffic: Traffic = Field(
        default=Traffic.REPLICA_RATIO,
        description="ReplicaRatio: after the accuracy gate, the canary joins the target's Service. Synthetic: it "
        "never takes user traffic; the latency probe drives it. InferencePool: the canary gets an InferencePool of "
        "its own and the HTTPRoute in rollout.inferencePool sends it the share each step names.",
    )
    inference_pool: InferencePoolTraffic | None = Field(
        default=None, description="The HTTPRoute and InferencePool of traffic InferencePool."
    )
    routing_group: RoutingGroupTraffic | None = Field(
        default=None,
        description="traffic ReplicaRatio on a target in a KServe routing group: the canary's share at each step "
        "(unset: 10% then 50%).",
    )
    paused: Bool = Field(
        default=False, description="Hold the rollout where it is (a drifted target is then only reported)."
    )
    abort: Bool = Field(default=False, description="Abort and roll back to BF16.")
    approval: Approval = Field(default=Approval.AUTOMATIC, description="Manual holds before promotion.")
    approval_timeout_seconds: Int = Field(
        default=86_400,
        ge=1,
        le=MAX_DURATION_SECONDS,
        description="With Manual approval: how long a rollout may wait in AwaitingApproval (at most a week). Past "
        "it the rollout is rolled back (ApprovalTimedOut): an unapproved change is never promoted, and its canary "
        "stops holding GPUs and serving users (`kubectl kvpolicy retry` runs it again). While it waits the latency "
        "analysis keeps checking a canary that serves users, and an approval promotes only on a passing check made "
        "within the last two gates.latency.intervalSeconds.",
    )
    approved_rollout: str | None = Field(
        default=None,
        pattern=ROLLOUT_ID_PATTERN,
        description="With Manual approval: the status.rolloutId to promote (`kubectl kvpolicy approve`). It approves "
        "that rollout only; a restarted or later rollout has another id and waits for its own approval.",
    )
    retry_rollout: str | None = Field(
        default=None,
        pattern=ROLLOUT_ID_PATTERN,
        description="The status.rolloutId of a RolledBack rollout to run again (`kubectl kvpolicy retry`).",
    )
    approved: Bool = Field(
        default=False,
        description="Deprecated: approves nothing (it used to approve every later rollout too). Set "
        "approvedRollout instead; a rollout awaiting approval with this set gets a Warning event saying so.",
    )
    apply_mode: ApplyMode = Field(
        default=ApplyMode.PATCH,
        description="Patch: the operator patches the target. Advisory: it never writes the target; after the gates "
        "it publishes the change (status.advice and an event) and the rollout is Promoted once the target's pods "
        "run it (for GitOps: see docs/gitops.md).",
    )
    on_drift: OnDrift | None = Field(
        default=None,
        description="When a decided target's serving configuration (image, command, arguments, env of the vLLM "
        "container) changes: Reevaluate plans and gates again, Report only sets the Drifted condition. Unset: "
        "Reevaluate after an FP8 decision, Report after a BF16 one.",
    )


class SecretKeySelector(_Model):
    """A key of a Secret in the policy's namespace (for the operator's defaults: in the operator's namespace)."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    key: str = Field(min_length=1, max_length=253, description="The key in the Secret's data.")


class ConfigMapKeySelector(_Model):
    """A key of a ConfigMap in the policy's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the ConfigMap.")
    key: str = Field(min_length=1, max_length=253, description="The key in the ConfigMap's data.")


# ---------------------------------------------------------------------------------------------- authentication
# Credentials by reference only (Kubernetes' SecretKeySelector, as the Prometheus Operator's SafeTLSConfig and
# BasicAuth spell them): a value never appears in the spec, the status, events, Job arguments or logs.


class VllmAuth(_Model):
    """How the gate Jobs authenticate to the canary and baseline servers (vLLM's `--api-key` / VLLM_API_KEY)."""

    api_key_secret_ref: SecretKeySelector = Field(
        description="The Secret key holding the servers' API key, sent as `Authorization: Bearer` by the gate Jobs "
        "(given to them as an env var from the Secret, never as an argument). vLLM 0.32 checks it on /v1/* only, "
        "so the operator's own reads of /metrics send no key."
    )


class SecretOrConfigMap(_Model):
    """A PEM bundle from a Secret key or a ConfigMap key (exactly one)."""

    rules = (
        Rule(
            cel="has(self.secret) != has(self.configMap)",
            message="set exactly one of secret or configMap",
            check=lambda m: (m.secret is None) != (m.config_map is None),
        ),
    )

    secret: SecretKeySelector | None = None
    config_map: ConfigMapKeySelector | None = None


class BasicAuth(_Model):
    """HTTP basic auth from two Secret keys."""

    username: SecretKeySelector = Field(description="The Secret key holding the user name.")
    password: SecretKeySelector = Field(description="The Secret key holding the password.")


class HeaderValueSource(_Model):
    secret_key_ref: SecretKeySelector = Field(description="The Secret key holding the header's value.")


HEADER_NAME_PATTERN = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"


class HttpHeader(_Model):
    """An extra request header: a plain value (a tenant such as X-Scope-OrgID) or one from a Secret (exactly one)."""

    rules = (
        Rule(
            cel="has(self.value) != has(self.valueFrom)",
            message="a header takes exactly one of value or valueFrom",
            check=lambda m: (m.value is None) != (m.value_from is None),
        ),
        Rule(
            cel="!self.name.matches('^(?i)authorization$')",
            message="the Authorization header comes from bearerTokenSecretRef or basicAuth, not from headers",
            check=lambda m: m.name.lower() != "authorization",
        ),
    )

    name: str = Field(min_length=1, max_length=256, pattern=HEADER_NAME_PATTERN, description="Header name.")
    value: str | None = Field(default=None, max_length=4096, description="Header value (not secret).")
    value_from: HeaderValueSource | None = Field(default=None, description="Header value from a Secret key.")


class TlsConfig(_Model):
    """TLS to an https endpoint: the CA bundle to trust (default: the system's) and an optional client certificate."""

    rules = (
        Rule(
            cel="has(self.cert) == has(self.keySecret)",
            message="a client certificate needs both tls.cert and tls.keySecret",
            check=lambda m: (m.cert is None) == (m.key_secret is None),
        ),
    )

    ca: SecretOrConfigMap | None = Field(default=None, description="PEM CA bundle that signed the server certificate.")
    cert: SecretOrConfigMap | None = Field(default=None, description="PEM client certificate.")
    key_secret: SecretKeySelector | None = Field(default=None, description="The Secret key holding the client key.")
    insecure_skip_verify: Bool = Field(
        default=False, description="Do not verify the server's certificate (only when asked for; never the default)."
    )


class PrometheusAuth(_Model):
    """How the operator authenticates to Prometheus (thanos-querier, Mimir, an ingress with a private CA)."""

    rules = (
        Rule(
            cel="!(has(self.bearerTokenSecretRef) && has(self.basicAuth))",
            message="prometheusAuth takes bearerTokenSecretRef or basicAuth, not both",
            check=lambda m: m.bearer_token_secret_ref is None or m.basic_auth is None,
        ),
    )

    bearer_token_secret_ref: SecretKeySelector | None = Field(
        default=None, description="The Secret key holding a bearer token (`Authorization: Bearer`)."
    )
    basic_auth: BasicAuth | None = Field(default=None, description="Basic auth from Secret keys.")
    headers: list[HttpHeader] = Field(
        default_factory=list, max_length=16, description="Extra headers on every query (e.g. X-Scope-OrgID)."
    )
    tls: TlsConfig | None = Field(default=None, description="TLS settings; needs an https prometheusURL.")

    def secret_refs(self) -> list[SecretKeySelector]:
        """Every Secret key this configuration reads."""
        refs = [self.bearer_token_secret_ref] if self.bearer_token_secret_ref else []
        if self.basic_auth is not None:
            refs += [self.basic_auth.username, self.basic_auth.password]
        refs += [h.value_from.secret_key_ref for h in self.headers if h.value_from is not None]
        if self.tls is not None:
            refs += [source.secret for source in (self.tls.ca, self.tls.cert) if source and source.secret]
            refs += [self.tls.key_secret] if self.tls.key_secret else []
        return refs


class NotificationSpec(_Model):
    """A webhook that is told about the rollout's phase changes, decisions and drift."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Names the receiver in events, logs and metrics (its URL never appears there).",
    )
    format: WebhookFormat = Field(
        default=WebhookFormat.CLOUD_EVENTS,
        description="CloudEvents (structured JSON), Slack (incoming webhook) or Teams (Workflows webhook, an "
        "Adaptive Card).",
    )
    url_secret_ref: SecretKeySelector = Field(
        alias="urlSecretRef", description="The Secret key holding the webhook URL (http or https)."
    )
    events: list[NotificationEvent] = Field(
        default=[NotificationEvent.PHASE_CHANGED, NotificationEvent.DECIDED, NotificationEvent.DRIFTED],
        min_length=1,
        max_length=3,
        description="What to send: PhaseChanged, Decided, Drifted.",
    )


# The gate's length in CEL (`KVPolicySpec.accuracy_length`), and 2^(buckets - 1): CEL has no power operator.
_CEL_ACCURACY_LENGTH = (
    "(has(self.gates.accuracy.lengthTokens) ? self.gates.accuracy.lengthTokens : self.workload.maxContextTokens)"
)
_CEL_HALVINGS = f"{[2**k for k in range(MAX_PROFILE_BUCKETS)]}[self.gates.accuracy.lengthProfile.buckets - 1]"


class KVPolicySpec(_Model):
    rules = (
        Rule(
            cel="!has(self.rollout) || !has(self.rollout.approvalTimeoutSeconds) || !has(self.gates) "
            "|| !has(self.gates.latency) || !has(self.gates.latency.intervalSeconds) "
            "|| self.rollout.approvalTimeoutSeconds >= 2 * self.gates.latency.intervalSeconds",
            message="rollout.approvalTimeoutSeconds must be at least twice gates.latency.intervalSeconds (an approval "
            "promotes only on a passing latency check made within two intervals)",
            check=lambda m: m.rollout.approval_timeout_seconds >= 2 * m.gates.latency.interval_seconds,
            values=lambda m: f"{m.rollout.approval_timeout_seconds} < 2 * {m.gates.latency.interval_seconds}",
            values_cel="string(self.rollout.approvalTimeoutSeconds) + ' < 2 * ' "
            "+ string(self.gates.latency.intervalSeconds)",
        ),
        Rule(
            cel="self.workload.maxContextTokens <= self.model.maxModelLen",
            message="workload.maxContextTokens must not exceed model.maxModelLen",
            check=lambda m: m.workload.max_context_tokens <= m.model.max_model_len,
            values=lambda m: f"{m.workload.max_context_tokens} > {m.model.max_model_len}",
            values_cel="string(self.workload.maxContextTokens) + ' > ' + string(self.model.maxModelLen)",
        ),
        Rule(
            cel="!has(self.gates) || !has(self.gates.accuracy) || !has(self.gates.accuracy.lengthTokens) "
            "|| self.gates.accuracy.lengthTokens <= self.model.maxModelLen",
            message="gates.accuracy.lengthTokens must not exceed model.maxModelLen",
            check=lambda m: (
                m.gates.accuracy.length_tokens is None or m.gates.accuracy.length_tokens <= m.model.max_model_len
            ),
            values=lambda m: f"{m.gates.accuracy.length_tokens} > {m.model.max_model_len}",
            values_cel="string(self.gates.accuracy.lengthTokens) + ' > ' + string(self.model.maxModelLen)",
        ),
        Rule(
            cel="!has(self.gates) || !has(self.gates.accuracy) || !has(self.gates.accuracy.lengthProfile) "
            "|| !has(self.gates.accuracy.lengthProfile.buckets) || self.gates.accuracy.lengthProfile.buckets == 1 "
            f"|| {_CEL_ACCURACY_LENGTH} / {MIN_PROFILE_BUCKET_TOKENS} >= {_CEL_HALVINGS}",
            message=f"gates.accuracy.lengthProfile.buckets halves the gate length (lengthTokens, else "
            f"workload.maxContextTokens) buckets - 1 times: the shortest bucket must be at least "
            f"{MIN_PROFILE_BUCKET_TOKENS} tokens",
            check=lambda m: (
                m.gates.accuracy.length_profile.buckets == 1
                or m.accuracy_length >> (m.gates.accuracy.length_profile.buckets - 1) >= MIN_PROFILE_BUCKET_TOKENS
            ),
            values=lambda m: (
                f"{m.gates.accuracy.length_profile.buckets} buckets of {m.accuracy_length} tokens: the shortest is "
                f"{m.accuracy_length >> (m.gates.accuracy.length_profile.buckets - 1)}"
            ),
            values_cel=f"string(self.gates.accuracy.lengthProfile.buckets) + ' buckets of ' + "
            f"string({_CEL_ACCURACY_LENGTH}) + ' tokens: the shortest is ' + "
            f"string({_CEL_ACCURACY_LENGTH} / {_CEL_HALVINGS})",
        ),
        Rule(
            cel="!has(self.model.slidingWindow) || !has(self.model.slidingWindow.layers) "
            "|| self.model.slidingWindow.layers.all(i, i < self.model.numLayers)",
            message="model.slidingWindow.layers must be layer indices below model.numLayers",
            check=lambda m: (
                m.model.sliding_window is None
                or m.model.sliding_window.layers is None
                or all(i < m.model.num_layers for i in m.model.sliding_window.layers)
            ),
            values=lambda m: (
                f"{next(i for i in m.model.sliding_window.layers if i >= m.model.num_layers)} >= {m.model.num_layers}"
            ),
            values_cel="string(self.model.slidingWindow.layers.filter(i, i >= self.model.numLayers)[0]) + ' >= ' "
            "+ string(self.model.numLayers)",
        ),
        Rule(
            cel="!has(self.model.slidingWindow) || !has(self.model.slidingWindow.count) "
            "|| self.model.slidingWindow.count <= self.model.numLayers",
            message="model.slidingWindow.count must not exceed model.numLayers",
            check=lambda m: (
                m.model.sliding_window is None
                or m.model.sliding_window.count is None
                or m.model.sliding_window.count <= m.model.num_layers
            ),
            values=lambda m: f"{m.model.sliding_window.count} > {m.model.num_layers}",
            values_cel="string(self.model.slidingWindow.count) + ' > ' + string(self.model.numLayers)",
        ),
        Rule(
            cel="!has(self.analysis) || !has(self.analysis.checks) || size(self.analysis.checks) == 0 "
            "|| (has(self.gates) && has(self.gates.latency) && has(self.gates.latency.provider) "
            "&& self.gates.latency.provider == 'Prometheus')",
            message="analysis.checks need gates.latency.provider Prometheus (and its prometheusURL)",
            check=lambda m: (
                m.analysis is None or not m.analysis.checks or m.gates.latency.provider == LatencyProvider.PROMETHEUS
            ),
        ),
        Rule(
            cel="!has(self.analysis) || !has(self.analysis.checks) || size(self.analysis.checks) == 0 "
            "|| ((!has(self.rollout) || !has(self.rollout.traffic) || self.rollout.traffic != 'Synthetic') "
            "&& (!has(self.gates) || !has(self.gates.latency) || !has(self.gates.latency.enabled) "
            "|| self.gates.latency.enabled))",
            message="analysis.checks run in the live latency analysis: they need rollout.traffic ReplicaRatio or "
            "InferencePool and gates.latency.enabled",
            check=lambda m: (
                m.analysis is None
                or not m.analysis.checks
                or (m.rollout.traffic != Traffic.SYNTHETIC and m.gates.latency.enabled)
            ),
        ),
    )

    target_ref: TargetRef
    model: ModelSpec
    workload: WorkloadSpec
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    images: ImagesSpec = Field(default_factory=ImagesSpec)
    gates: GatesSpec = Field(default_factory=GatesSpec)
    vllm_auth: VllmAuth | None = Field(
        default=None, description="The API key the canary and baseline servers want (vLLM --api-key), by reference."
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    analysis: AnalysisSpec | None = Field(
        default=None, description="The live latency analysis' series selector and custom checks."
    )
    gpu_node_selector: dict[str, str] | None = Field(
        default=None,
        description="Labels of the nodes the target runs on; defaults to the target's pod nodeSelector, "
        "then to nvidia.com/gpu.present=true.",
    )
    notifications: list[NotificationSpec] | None = Field(
        default=None,
        max_length=8,
        description="Webhooks told about phase changes, decisions and drift; unset: the operator's default "
        "receivers (chart value notifications.defaults).",
    )

    @property
    def accuracy_length(self) -> int:
        """The longest context the gates must vouch for (the GPU probe measures attention up to it). The prompts the
        gate tools send are `capped_accuracy_length`."""
        return self.gates.accuracy.length_tokens or self.workload.max_context_tokens

    @property
    def capped_accuracy_length(self) -> int:
        """The longest prompt a gate sends: `accuracy_length`, less room for the answer when it would not fit."""
        return max(1, min(self.accuracy_length, self.model.max_model_len - ANSWER_HEADROOM_TOKENS))


# --------------------------------------------------------------------------------------------------------- status


class Severity(StrEnum):
    INFO = "Info"
    WARNING = "Warning"


class PlanReason(_Model):
    code: str = Field(description="Machine-readable CamelCase code.")
    message: str = Field(description="A human sentence.")
    severity: Severity = Severity.INFO


class Plan(_Model):
    kv_cache_dtype: KVCacheDtype = Field(description="FP8 or BF16: what the canary (or the target) runs.")
    vllm_kv_cache_dtype: str = Field(description="The value passed to --kv-cache-dtype (fp8 or auto).")
    skip_layers: list[str] = Field(default_factory=list, description="--kv-cache-dtype-skip-layers values.")
    image: str | None = Field(default=None, description="Image for the canary; unset = the target's current image.")
    attention_backend: str | None = Field(default=None, description="--attention-backend value, if any.")
    extra_args: list[str] = Field(default_factory=list, description="All vLLM arguments the plan adds.")
    gates: list[str] = Field(default_factory=list, description="Gates to run: GpuPreflight, Accuracy, Latency.")
    reasons: list[PlanReason] = Field(default_factory=list)

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype == KVCacheDtype.FP8


class GpuGeneration(StrEnum):
    AMPERE = "Ampere"
    ADA = "Ada"
    HOPPER = "Hopper"
    BLACKWELL = "Blackwell"
    UNKNOWN = "Unknown"


class GpuFacts(_Model):
    generation: GpuGeneration
    compute_capability: str | None = Field(default=None, description='e.g. "9.0".')
    pool_capabilities: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Every compute capability the target's pods may land on (a mixed pool has several); the attention "
        "backend must run on all of them.",
    )
    product: str | None = None
    nodes: int = Field(default=0, ge=0, description="GPU nodes considered.")
    mixed: bool = Field(default=False, description="The nodes span several generations.")
    source: str = Field(description="Which labels decided: ComputeCapability, Family, Product or None.")
    message: str = ""

    @property
    def sim_name(self) -> str | None:
        """Lower-case short product name (h100, h200, b200, a100, l40s) when recognisable."""
        if not self.product:
            return None
        for short in ("H100", "H200", "B200", "GB200", "A100", "L40S"):
            if short in self.product.upper():
                return short.lower()
        return None


def _utc(value: Any) -> Any:
    """A status timestamp as the API stores it (RFC 3339) or as the operator makes it: zone-less is UTC, and it keeps
    the milliseconds the API keeps, so a status the step made equals the one it reads back."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)  # "Invalid isoformat string: ..." for anything else
    if not isinstance(value, datetime):
        return value
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.replace(microsecond=value.microsecond // 1000 * 1000)


def _rfc3339(moment: datetime) -> str:
    """RFC 3339 in UTC with milliseconds and 'Z': phase deadlines of a few seconds stay exact."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# A moment in status: a timezone-aware datetime in the model, RFC 3339 text in the API (the CRD says date-time).
Timestamp = Annotated[datetime, BeforeValidator(_utc), PlainSerializer(_rfc3339, return_type=str, when_used="json")]


class _Status(_Model):
    # Assignments are validated too: a moment assigned as the step's clock or as text is kept as the API keeps it.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True)


class Condition(_Status):
    """metav1.Condition."""

    type: str
    status: str = Field(pattern=r"^(True|False|Unknown)$")
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: Timestamp
    observed_generation: int | None = None


class LengthBucketResult(_Model):
    """One bucket of the accuracy gate's length profile: its paired needles (canaryOnly / baselineOnly: the needles
    one side answered and the other missed)."""

    length_tokens: int
    prompts: int
    needles: int
    canary_score: float | None = None
    baseline_score: float | None = None
    recovery: float | None = None
    canary_only: int = 0
    baseline_only: int = 0


class LengthProfileResult(_Model):
    """The accuracy gate's length profile (gates.accuracy.lengthProfile): per bucket, shortest first; the AUC of
    each side's score over log2(length) (the mean score per doubling of length) and their ratio; and the sign test
    of a systematic shift (the canary below the baseline in every bucket, shown at the gate's confidence)."""

    buckets: list[LengthBucketResult] = Field(default_factory=list)
    canary_auc: float | None = None
    baseline_auc: float | None = None
    auc_recovery: float | None = None
    systematic_shift: bool = False
    shift_p_value: float | None = Field(default=None, description="One-sided sign test over the discordant needles.")
    negative_buckets: int = Field(default=0, description="Buckets where the canary scores below the baseline.")


class GateResult(_Status):
    """A finished (or running) gate: accuracy, GPU preflight or latency probe."""

    verdict: JobVerdictWord = Field(description="Pass, Fail, Breach, Safe, Unsafe, Inconclusive, Error (or Running).")
    reason: str = ""
    message: str = ""
    job: str | None = None
    length_tokens: int | None = None
    samples: int | None = None
    canary_score: float | None = None
    baseline_score: float | None = None
    recovery: float | None = None
    recovery_low: float | None = None
    recovery_high: float | None = None
    profile: LengthProfileResult | None = Field(default=None, description="The accuracy gate's length profile.")
    task: AccuracyTask | None = Field(default=None, description="The accuracy gate's task.")
    prompt_format: PromptFormat | None = Field(
        default=None, description="How the accuracy gate sent its prompts: Chat or Completion (Auto resolved)."
    )
    finished_at: Timestamp | None = None


class LatencyCheck(_Status):
    verdict: CheckVerdictWord = Field(description="Pass, Breach, NoData or ProviderUnavailable.")
    reason: str = ""
    message: str = ""
    ratios: dict[str, float] = Field(default_factory=dict, description="e.g. ttft_p95: canary/baseline.")
    values: dict[str, float] = Field(
        default_factory=dict, description="Custom checks' figures: <name> (the canary's value), <name>_ratio."
    )
    canary_requests: int | None = None
    baseline_requests: int | None = None
    at: Timestamp | None = None


class LatencyAnalysis(_Status):
    started_at: Timestamp | None = None
    checks: int = 0
    passes: int = 0
    breaches: int = 0
    inconclusive: int = 0
    consecutive_failures: int = 0
    inconclusive_since: Timestamp | None = None
    last: LatencyCheck | None = None
    probe: GateResult | None = Field(default=None, description="The latency probe Job (Synthetic traffic).")


class ContainerRecord(_Model):
    """A vLLM container's serving configuration: its image, command, arguments and env, exactly."""

    image: str
    command: list[str] | None = None
    args: list[str] | None = None
    env: list[dict[str, Any]] | None = None


class PodTemplateRecord(ContainerRecord):
    """The target's serving configuration: its vLLM container's, and those of the other vLLM containers that hold the
    same model's KV cache and must change with it (a mixed group would pair two KV-cache formats)."""

    companions: dict[str, ContainerRecord] | None = Field(
        default=None,
        description="The target's other vLLM containers, by role: a LeaderWorkerSet's `worker`; an "
        "LLMInferenceService's `worker`, `prefill` and `prefill.worker`. Unset: it has none.",
    )


class Difference(_Model):
    """One way the target's serving configuration differs from what the policy expected."""

    field: str = Field(
        description="Image, Command, KVArguments, Arguments or Env; a companion container's are prefixed with its "
        "role (`worker KVArguments`)."
    )
    expected: str
    observed: str

    def describe(self) -> str:
        return f"{self.field}: {self.expected} -> {self.observed}"


class Drift(_Status):
    """The target no longer runs what the policy decided (or what its rollout was gated on)."""

    detected_at: Timestamp
    rollout_id: str | None = Field(default=None, description="The rollout whose decision the target left.")
    differences: list[Difference] = Field(default_factory=list, max_length=16)


class Advice(_Model):
    """Advisory mode: the exact change the target needs, for a GitOps repository to take."""

    rollout_id: str
    deployment: str
    container: str
    image: str
    command: list[str] | None = None
    args: list[str] | None = None
    strategic_merge_patch: str = Field(description="JSON: `kubectl patch deployment --type strategic -p ...`.")
    json_patch: str = Field(description="JSON: an RFC 6902 patch (`--type json`), testing the container's name first.")
    summary: str = Field(description="The change in words.")


class RouteRuleRecord(_Model):
    """One rule of the user's HTTPRoute as it was before the rollout edited it."""

    rule: int = Field(description="Index in spec.rules.")
    backend_refs: list[dict[str, Any]] = Field(description="The rule's backendRefs exactly as they were.")
    filters: list[dict[str, Any]] | None = Field(
        default=None, description="The rule's filters exactly as they were; unset: it had none."
    )


class TrafficStatus(_Status):
    """traffic InferencePool: where the rollout has the users' traffic, and how to put the route back."""

    route: str = Field(description="The HTTPRoute the rollout steps.")
    pool: str = Field(description="The baseline InferencePool.")
    canary_pool: str = Field(description="The canary's InferencePool (the operator's).")
    endpoint_picker: str | None = Field(
        default=None,
        description="endpointPicker CopyBaseline: the copied EPP's Deployment and Service (the operator's).",
    )
    mirroring: bool = Field(default=False, description="In the mirror phase, before the first step.")
    step: int = Field(default=0, description="Index of the current step in spec.rollout.inferencePool.steps.")
    weight: int = Field(default=0, description="The canary's intended share of the route's traffic now, percent.")
    shifted_at: Timestamp | None = Field(default=None, description="When the route was seen at this step's weight.")
    original: list[RouteRuleRecord] | None = Field(
        default=None, description="The route's rules as they were before the first edit; restored at the end."
    )
    advice: str | None = Field(
        default=None,
        description="applyMode Advisory: the JSON patch (RFC 6902) the route needs for this step, for a GitOps "
        "repository to take (`kubectl patch httproute --type json -p ...`).",
    )


class RoutingGroupStatus(_Status):
    """A canary in the target's routing group: the step it is at and the weight that gives it the step's share."""

    group: str = Field(description="The routing group (spec.router.route.group of the target).")
    step: int = Field(default=0, description="Index of the current step in spec.rollout.routingGroup.steps.")
    share_percent: int = Field(default=0, description="The share of the group's traffic this step gives the canary.")
    weight: int = Field(default=0, description="The canary's weight for that share beside the other members'.")
    since: Timestamp | None = Field(default=None, description="When the canary was first asked for this step's weight.")
    confirmed_at: Timestamp | None = Field(
        default=None, description="When the group's status listed the canary at this weight: the step counts."
    )


class TrafficShare(_Status):
    """The canary's share of the requests, as intended and as its own and the baseline's counters measured it over
    the latest analysis check's window (vllm:request_success_total)."""

    intended_percent: float = Field(
        description="The share the canary is meant to get (a step's weight, or its pods' share)."
    )
    measured_percent: float | None = Field(default=None, description="The share it got; unset with no requests at all.")
    canary_requests: float = 0.0
    baseline_requests: float = 0.0
    window_seconds: float = 0.0
    at: Timestamp


class Decision(_Status):
    result: DecisionResult = Field(description="Promoted, RolledBack or HeldBF16.")
    reason: str
    message: str = ""
    generation: int | None = None
    kv_cache_dtype: str | None = None
    time: Timestamp


class Parallelism(_Model):
    """How the served model is split across GPUs: vLLM's tensor, pipeline and data parallel sizes (1 when unset)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    def describe(self) -> str:
        return f"tensor {self.tensor}, pipeline {self.pipeline}, data {self.data}"


class CanaryRef(_Model):
    deployment: str
    service: str
    generation: int
    run: int = Field(default=1, ge=1, description="Which run of the rollout at this generation (drift, retries).")
    parallelism: Parallelism | None = Field(
        default=None, description="The target's parallel sizes when the canary was planned; the canary keeps them."
    )
    served_kv_cache_dtype: str | None = Field(
        default=None, description="The KV cache dtype the canary serves, from its vllm:cache_config_info."
    )
    served_skip_layers: list[str] | None = Field(
        default=None, description="The KV cache skip layers the canary serves, from its vllm:cache_config_info."
    )


class KVPolicyStatus(_Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", validate_assignment=True)

    phase: Phase | None = None
    phase_entered_at: Timestamp | None = None
    observed_generation: int | None = None
    message: str | None = None
    conditions: list[Condition] = Field(default_factory=list)
    plan: Plan | None = None
    gpu: GpuFacts | None = None
    canary: CanaryRef | None = None
    preflight: GateResult | None = None
    accuracy: GateResult | None = None
    latency: LatencyAnalysis | None = None
    decision: Decision | None = None
    history: list[Decision] = Field(default_factory=list, max_length=10)
    previous_template: PodTemplateRecord | None = None
    spec_hash: str | None = Field(
        default=None, description="Hash of the spec fields that define the rollout; a change restarts it."
    )
    rollout_generation: int | None = Field(default=None, description="The generation the current rollout runs.")
    rollout_run: int | None = Field(
        default=None, description="Runs of a rollout at this generation so far (drift and retries run it again)."
    )
    rollout_started_at: Timestamp | None = Field(default=None, description="When the current rollout started planning.")
    rollout_id: str | None = Field(
        default=None,
        description="Identifies the current rollout (<generation>-<hash>); approvals and retries name it, so they "
        "never carry over to another rollout.",
    )
    target_base: PodTemplateRecord | None = Field(
        default=None,
        description="The target's serving configuration the current rollout started from (the canary is it plus the "
        "plan). A target that no longer matches it before the promotion restarts the analysis.",
    )
    target_decided: PodTemplateRecord | None = Field(
        default=None, description="What the decision says the target runs; a difference is drift."
    )
    drift: Drift | None = Field(default=None, description="How the target differs from the decision, if it does.")
    advice: Advice | None = Field(default=None, description="Advisory mode: the change the target needs.")
    traffic: TrafficStatus | None = Field(
        default=None, description="traffic InferencePool: the route's weights the rollout set, and what it restores."
    )
    traffic_share: TrafficShare | None = Field(
        default=None, description="The canary's share of the users' requests, intended and measured."
    )
    routing_group: RoutingGroupStatus | None = Field(
        default=None, description="A target in a routing group: where the canary's weight is."
    )
    retained_canary: str | None = Field(
        default=None,
        description="A promoted canary kept stopped as a way back (an LLMInferenceService with "
        "serving.kserve.io/stop: its GPUs freed, its configuration at hand); the next rollout deletes it.",
    )


class KVPolicy(BaseModel):
    """A whole KVPolicy object (metadata kept as the API gives it)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    api_version: str = Field(default=API_VERSION, alias="apiVersion")
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: KVPolicySpec
    status: KVPolicyStatus = Field(default_factory=KVPolicyStatus)

    @field_validator("api_version", "kind")
    @classmethod
    def _this_resource(cls, value: str, info: ValidationInfo) -> str:
        field, expected = {"api_version": ("apiVersion", API_VERSION), "kind": ("kind", KIND)}[str(info.field_name)]
        if value != expected:
            raise ValueError(f"{field} must be {expected} (got {value!r})")
        return value

    @field_validator("metadata")
    @classmethod
    def _names(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        """The name and namespace checks the API server applies to any custom resource."""
        checks = (
            ("name", NAME_PATTERN, NAME_MAX_LENGTH, "DNS-1123 subdomain"),
            ("namespace", NAMESPACE_PATTERN, NAMESPACE_MAX_LENGTH, "DNS-1123 label"),
        )
        for key, pattern, max_length, kind in checks:
            value = metadata.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or len(value) > max_length or not re.match(pattern, value):
                raise ValueError(
                    f"{key} {value!r} is not a valid {kind}: lowercase letters, digits and '-'"
                    f"{', or dots between parts' if key == 'name' else ''}, starting and ending with a letter or "
                    f"digit, at most {max_length} characters"
                )
        return metadata
