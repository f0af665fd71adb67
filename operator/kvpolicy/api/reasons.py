"""Every reason code kvpolicy writes, in one place: conditions, events and decisions (`Reason`, `DecisionReason`),
the planner's reasons (`PlanCode`), the gate tools' reports (`GateReason`), the latency checks (`AnalysisReason`) and
API requests that got no answer (`RequestReason`).

The README's reason tables and the alert runbooks are checked against these enums (tests/api/test_reasons.py): a
reason they name must exist here, and every decision reason must be documented there.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Condition and event reasons the operator writes (decision reasons are `DecisionReason`)."""

    ANALYSIS_RESTARTED = "AnalysisRestarted"
    # The plan's image is not the one the target runs: the gates judge that change as well as FP8 KV.
    CANARY_IMAGE_DIFFERS = "CanaryImageDiffers"
    ROLLOUT_RESTARTED = "RolloutRestarted"
    TARGET_NOT_FOUND = "TargetNotFound"
    INVALID_TARGET = "InvalidTarget"
    INVALID_SPEC = "InvalidSpec"
    RECONCILED = "Reconciled"
    CONFLICT = "Conflict"  # another KVPolicy governs the target
    API_REQUEST_REJECTED = "APIRequestRejected"  # a 4xx the request cannot recover from (422, 403, 400, 404 on create)
    GPU_CHANGED = "GPUChanged"
    PLANNED = "Planned"
    BF16_PLANNED = "BF16Planned"
    FP8_PLANNED = "FP8Planned"
    HELD_BF16 = "HeldBF16"
    CANARY_STARTING = "CanaryStarting"
    CANARY_READY = "CanaryReady"
    CANARY_UNSCHEDULABLE = "CanaryUnschedulable"
    CANARY_CONFIG_VERIFIED = "CanaryConfigVerified"  # event: the canary serves the planned KV cache
    SERVED_AS_PLANNED = "ServedAsPlanned"
    AWAITING_SERVED_CONFIG = "AwaitingServedConfig"  # the canary's vllm:cache_config_info is not readable yet
    SCHEDULED = "Scheduled"
    UNSCHEDULABLE = "Unschedulable"
    GATE_POD_NOT_STARTING = "GatePodNotStarting"  # a gate Job's pod cannot be pulled, configured or scheduled
    PREFLIGHT_PASSED = "PreflightPassed"
    PREFLIGHT_INCONCLUSIVE = "PreflightInconclusive"
    PREFLIGHT_TIMED_OUT = "PreflightTimedOut"
    PREFLIGHT_NOT_PROBED = "PreflightNotProbed"  # no probe backend measures the planned attention backend
    ACCUMULATION_SAFE = "AccumulationSafe"
    ACCUMULATION_UNSAFE = "AccumulationUnsafe"
    ACCURACY_GATE_PASSED = "AccuracyGatePassed"
    ACCURACY_GATE_FAILED = "AccuracyGateFailed"
    ACCURACY_GATE_INCONCLUSIVE = "AccuracyGateInconclusive"
    RECOVERY_ABOVE_MINIMUM = "RecoveryAboveMinimum"
    RECOVERY_BELOW_MINIMUM = "RecoveryBelowMinimum"
    # The length profile shows the canary below the baseline at every length (calibrate the KV scales).
    SYSTEMATIC_SHIFT = "SystematicShift"
    TRAFFIC_JOINED = "TrafficJoined"
    TRAFFIC_SHIFTED = "TrafficShifted"  # traffic InferencePool: the route sends the canary's pool this step's share
    SHIFTING_TRAFFIC = "ShiftingTraffic"  # the route's weights or the canary's pool are being written
    TRAFFIC_RESTORED = "TrafficRestored"  # the route's rules are as the user wrote them again, the canary pool gone
    ROUTE_CHANGE_ADVISED = "RouteChangeAdvised"  # applyMode Advisory: the route patch is published, not applied
    INFERENCE_POOL_SELECTS_TARGET = "InferencePoolSelectsTarget"  # ReplicaRatio behind an EPP: the share is skewed
    NO_INFERENCE_POOL = "NoInferencePool"  # ReplicaRatio: no InferencePool selects the target's pods
    SHARE_AS_INTENDED = "ShareAsIntended"  # the canary's measured share of the requests is near the intended one
    TRAFFIC_SHARE_SKEWED = "TrafficShareSkewed"  # it is far from it (an endpoint picker, a stale route, ...)
    NO_CANARY_TRAFFIC = "NoCanaryTraffic"  # the baseline served requests, the canary none
    TOO_FEW_REQUESTS = "TooFewRequests"  # too few requests in the window to tell a share
    LATENCY_ANALYSIS_STARTED = "LatencyAnalysisStarted"
    LATENCY_GATE_DISABLED = "LatencyGateDisabled"
    LATENCY_GATE_PASSED = "LatencyGatePassed"
    LATENCY_BREACH = "LatencyBreach"
    LATENCY_INCONCLUSIVE = "LatencyInconclusive"
    PROBE_WITHIN_THRESHOLDS = "ProbeWithinThresholds"
    BAKING = "Baking"
    AWAITING_APPROVAL = "AwaitingApproval"
    APPROVED = "Approved"
    # Approved, but the latest latency check is not a recent pass: the promotion waits for one.
    APPROVAL_AWAITS_ANALYSIS = "ApprovalAwaitsAnalysis"
    PROMOTING = "Promoting"
    PROMOTED = "Promoted"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    PAUSED = "Paused"
    RESUMED = "Resumed"
    ROLLOUT_PAUSED = "RolloutPaused"
    ROLLOUT_RESUMED = "RolloutResumed"
    DELETED = "Deleted"
    TARGET_DRIFTED = "TargetDrifted"
    TARGET_CHANGED = "TargetChanged"
    IN_SYNC = "InSync"
    DRIFT_REPORTED = "DriftReported"
    ADVISED = "ChangeAdvised"
    AWAITING_ADOPTION = "AwaitingAdoption"
    DEPRECATED_APPROVAL = "DeprecatedApproval"
    RETRY_REQUESTED = "RetryRequested"
    NOTIFICATION_FAILED = "NotificationFailed"


class DecisionReason(StrEnum):
    """Why the operator promoted or rolled back (status.decision.reason, the `reason` label of
    kvpolicy_decisions_total). A latency analysis that rolls back decides with its `AnalysisReason`, a BF16 plan
    with its `PlanCode` cause."""

    GATES_PASSED = "GatesPassed"
    ADOPTED = "Adopted"
    ABORTED = "Aborted"
    TARGET_NOT_FOUND = "TargetNotFound"
    CAPACITY_UNAVAILABLE = "CapacityUnavailable"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    APPROVAL_TIMED_OUT = "ApprovalTimedOut"  # Manual approval: not approved within rollout.approvalTimeoutSeconds
    CANARY_CONFIG_MISMATCH = "CanaryConfigMismatch"  # the canary does not serve the planned KV dtype / skip layers
    GPU_PREFLIGHT_UNSAFE = "GpuPreflightUnsafe"
    ACCURACY_RECOVERY_BELOW_MINIMUM = "AccuracyRecoveryBelowMinimum"
    ACCURACY_INCONCLUSIVE = "AccuracyInconclusive"
    # gates.accuracy.lengthProfile.onSystematicShift Fail: a systematic shift rolls back a passing gate.
    ACCURACY_SYSTEMATIC_SHIFT = "AccuracySystematicShift"
    ACCURACY_GATE_ERROR = "AccuracyGateError"
    ACCURACY_GATE_TIMEOUT = "AccuracyGateTimeout"
    LATENCY_BREACH = "LatencyBreach"
    LATENCY_INCONCLUSIVE = "LatencyInconclusive"
    LATENCY_PROBE_TIMEOUT = "LatencyProbeTimeout"
    TRAFFIC_ROUTE_UNUSABLE = "TrafficRouteUnusable"  # the HTTPRoute or the baseline InferencePool cannot carry it


class PlanCode(StrEnum):
    """The planner's reasons (status.plan.reasons[].code)."""

    MIXED_GPU_GENERATIONS = "MixedGPUGenerations"
    UNKNOWN_GPU = "UnknownGPU"
    NO_TWO_LEVEL_IMAGE = "NoTwoLevelImage"
    TWO_LEVEL_ACCUMULATION_IMAGE = "TwoLevelAccumulationImage"
    # A truncating GPU planned with a backend that has no two-level accumulation (only vLLM's FA3 has it).
    BACKEND_WITHOUT_TWO_LEVEL = "BackendWithoutTwoLevelAccumulation"
    # Compute capability 12.x: no published measurement of its FP8 attention accumulation.
    UNMEASURED_COMPUTE_CAPABILITY = "UnmeasuredComputeCapability"
    BLACKWELL_NO_FIX_NEEDED = "BlackwellNoFixNeeded"
    NO_FP8_TENSOR_CORES = "NoFP8TensorCores"
    NO_FP8_ATTENTION_BACKEND = "NoFP8AttentionBackend"
    MLA_REQUIRES_CALIBRATED_SCALES = "MLARequiresCalibratedScales"
    BELOW_DECODE_BREAK_EVEN = "BelowDecodeBreakEven"
    ABOVE_DECODE_BREAK_EVEN = "AboveDecodeBreakEven"
    FAST_HEAD_DIM_256_PATH = "FastHeadDim256Path"
    HEAD_DIM_256_PREFILL_PENALTY = "HeadDim256PrefillPenalty"
    HEAD_DIM_256_PREFILL_COST = "HeadDim256PrefillCost"
    SKIP_SLIDING_WINDOW_LAYERS = "SkipSlidingWindowLayers"
    SLIDING_WINDOW_LAYERS_FP8 = "SlidingWindowLayersFP8"
    BF16_REQUESTED = "BF16Requested"
    FP8_REFUSED = "FP8Refused"
    FP8_REQUESTED = "FP8Requested"
    HOLD_BF16 = "HoldBF16"
    CALIBRATED_SCALES = "CalibratedScales"
    UNCALIBRATED_SCALES = "UncalibratedScales"
    ACCURACY_GATE_DISABLED = "AccuracyGateDisabled"
    CANARY_FP8 = "CanaryFP8"
    VLLM_VERSION = "VLLMVersion"  # the declared vLLM version and the version table's row for it
    VLLM_VERSION_UNDECLARED = "VLLMVersionUndeclared"  # none declared: planned avoiding every known-bad combination
    VLLM_VERSION_OUTSIDE_TABLE = "VLLMVersionOutsideTable"  # no row for it: planned conservatively
    ATTENTION_BACKEND_REQUESTED = "AttentionBackendRequested"  # kvCache.attentionBackend replaces the planner's pick
    KNOWN_BAD_COMBINATION = "KnownBadCombination"  # the requested backend is known to answer wrongly on this GPU


class GateReason(StrEnum):
    """Reasons in the gate tools' reports (GateReport.reason), and the operator's for a report it cannot read."""

    RECOVERY_ABOVE_THRESHOLD = "RecoveryAboveThreshold"
    RECOVERY_BELOW_THRESHOLD = "RecoveryBelowThreshold"
    SAMPLE_CAP_REACHED = "SampleCapReached"
    BASELINE_TOO_WEAK = "BaselineTooWeak"
    LENGTH_TOO_SHORT = "LengthTooShort"
    LENGTH_EXCEEDS_MAX_MODEL_LEN = "LengthExceedsMaxModelLen"
    PROMPT_LENGTH_MISMATCH = "PromptLengthMismatch"
    TOKENIZER_MISMATCH = "TokenizerMismatch"
    TOKENIZER_UNSUPPORTED = "TokenizerUnsupported"
    CHAT_TEMPLATE_MISSING = "ChatTemplateMissing"
    MALFORMED_RESPONSE = "MalformedResponse"
    ENDPOINT_UNAVAILABLE = "EndpointUnavailable"
    REQUEST_REJECTED = "RequestRejected"
    UNAUTHORIZED = "Unauthorized"
    CREDENTIALS_UNREADABLE = "CredentialsUnreadable"
    LATENCY_WITHIN_LIMITS = "LatencyWithinLimits"
    LATENCY_ABOVE_LIMIT = "LatencyAboveLimit"
    ACCUMULATION_SAFE = "AccumulationSafe"
    ACCUMULATION_UNSAFE = "AccumulationUnsafe"
    PROBE_COULD_NOT_RUN = "ProbeCouldNotRun"
    REPORT_MISSING = "ReportMissing"
    REPORT_UNREADABLE = "ReportUnreadable"
    REPORT_TOO_LARGE = "ReportTooLarge"


# The operator's reasons for a Job that left no readable report.
REPORT_PROBLEMS = frozenset({GateReason.REPORT_MISSING, GateReason.REPORT_UNREADABLE, GateReason.REPORT_TOO_LARGE})


class AnalysisReason(StrEnum):
    """Latency analysis checks (status.latency.last.reason) and their outcomes."""

    WITHIN_THRESHOLDS = "WithinThresholds"
    TTFT_RATIO_EXCEEDED = "TTFTRatioExceeded"
    ITL_RATIO_EXCEEDED = "ITLRatioExceeded"
    LATENCY_RATIO_EXCEEDED = "LatencyRatioExceeded"
    ERROR_RATIO_EXCEEDED = "ErrorRatioExceeded"
    NO_CANARY_SERIES = "NoCanarySeries"
    NO_BASELINE_SERIES = "NoBaselineSeries"
    TOO_FEW_CANARY_REQUESTS = "TooFewCanaryRequests"
    TOO_FEW_BASELINE_REQUESTS = "TooFewBaselineRequests"
    MISSING_LATENCY_QUANTILE = "MissingLatencyQuantile"
    MISSING_LATENCY_MEAN = "MissingLatencyMean"
    PROMETHEUS_UNREACHABLE = "PrometheusUnreachable"
    PROMETHEUS_TLS_ERROR = "PrometheusTLSError"
    PROMETHEUS_UNAUTHORIZED = "PrometheusUnauthorized"
    CREDENTIALS_UNREADABLE = "CredentialsUnreadable"
    # prometheusAuth names a Secret (or ConfigMap) the operator cannot use: not there, without the key, not readable.
    CREDENTIALS_SECRET_MISSING = "CredentialsSecretMissing"
    CREDENTIALS_KEY_MISSING = "CredentialsKeyMissing"
    CREDENTIALS_SECRET_UNREADABLE = "CredentialsSecretUnreadable"
    PROMETHEUS_TIMEOUT = "PrometheusTimeout"
    PROMETHEUS_SERVER_ERROR = "PrometheusServerError"
    QUERY_REJECTED = "QueryRejected"
    SCRAPE_FAILED = "ScrapeFailed"
    SCRAPE_UNPARSEABLE = "ScrapeUnparseable"
    CUSTOM_CHECK_BREACHED = "CustomCheckBreached"  # a custom check's value or ratio left its range
    CUSTOM_CHECK_NO_DATA = "CustomCheckNoData"  # a custom check's query returned no series, or NaN
    CUSTOM_CHECK_QUERY_REJECTED = "CustomCheckQueryRejected"  # Prometheus refused the query, or it is not one value
    CUSTOM_CHECK_NEEDS_PROMETHEUS = "CustomCheckNeedsPrometheus"  # custom checks run only through Prometheus
    ANALYSIS_PASSED = "AnalysisPassed"
    BAKING = "Baking"
    ANALYSIS_STALLED = "AnalysisStalled"


class RequestReason(StrEnum):
    """Why a request to the API server got no answer from it (`ApiError` code 0; the API server's own reasons, such as
    `Conflict` or `NotFound`, come with its answer), or why the API probe failed: the `reason` label of
    kvpolicy_reconcile_errors_total and kvpolicy_api_probe_failures_total."""

    CONNECTION_ERROR = "ConnectionError"
    TIMEOUT = "Timeout"
    WATCH_FAILED = "WatchFailed"
    CREDENTIALS_UNAVAILABLE = "CredentialsUnavailable"  # the kubeconfig's or service account's token cannot be read
    NOT_LEADER = "NotLeader"  # a write this replica refused to send: it does not hold the leader Lease


# Planner causes that make a plan BF16, most specific first: the first present names the HeldBF16 decision.
BF16_CAUSES = (
    PlanCode.UNKNOWN_GPU,
    PlanCode.NO_TWO_LEVEL_IMAGE,
    PlanCode.MLA_REQUIRES_CALIBRATED_SCALES,
    PlanCode.NO_FP8_TENSOR_CORES,
    PlanCode.NO_FP8_ATTENTION_BACKEND,
    PlanCode.HEAD_DIM_256_PREFILL_PENALTY,
    PlanCode.BELOW_DECODE_BREAK_EVEN,
    PlanCode.BF16_REQUESTED,
    PlanCode.FP8_REFUSED,
)

# Latency analysis reasons a rollback can be decided with.
ANALYSIS_ROLLBACK_REASONS = frozenset(
    {
        AnalysisReason.TTFT_RATIO_EXCEEDED,
        AnalysisReason.ITL_RATIO_EXCEEDED,
        AnalysisReason.LATENCY_RATIO_EXCEEDED,
        AnalysisReason.ERROR_RATIO_EXCEEDED,
        AnalysisReason.CUSTOM_CHECK_BREACHED,
        AnalysisReason.ANALYSIS_STALLED,
    }
)

# Every reason a decision may carry: the README must document each one.
DECISION_REASONS: frozenset[str] = frozenset({*DecisionReason, *BF16_CAUSES, *ANALYSIS_ROLLBACK_REASONS})

ALL_REASONS: frozenset[str] = frozenset(
    {*Reason, *DecisionReason, *PlanCode, *GateReason, *AnalysisReason, *RequestReason}
)

# Latency check reasons that say a credential the spec references cannot be used: worth a Warning event at once.
CREDENTIAL_PROBLEMS = frozenset(
    {
        AnalysisReason.CREDENTIALS_SECRET_MISSING,
        AnalysisReason.CREDENTIALS_KEY_MISSING,
        AnalysisReason.CREDENTIALS_SECRET_UNREADABLE,
        AnalysisReason.CREDENTIALS_UNREADABLE,
        AnalysisReason.PROMETHEUS_UNAUTHORIZED,
    }
)
