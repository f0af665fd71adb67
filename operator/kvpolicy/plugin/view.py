"""What `kubectl kvpolicy` shows, rendered from API objects as the API server returns them: pure, so it is tested
without a cluster and the live view is just this, redrawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from kvpolicy.api.v1alpha1 import (
    AnalysisPhase,
    ApplyMode,
    Approval,
    Condition,
    ConditionType,
    DecisionResult,
    GateResult,
    GateVerdict,
    KVPolicy,
    KVPolicySpec,
    KVPolicyStatus,
    LatencyAnalysis,
    LengthProfileResult,
    OnDrift,
    Phase,
    Plan,
    Severity,
)
from kvpolicy.rollout.conditions import condition_holds
from kvpolicy.rollout.gates import PHASE_GATES
from kvpolicy.rollout.step_types import parse_timestamp

Obj = dict[str, Any]

PASSED = "✔"
FAILED = "✖"
RUNNING = "◌"
PAUSED = "॥"
WARNING = "⚠"
NOT_PLANNED = "-"
# Message cells in tables are cut to this many characters (the whole text is in `kubectl get -o yaml`).
MESSAGE_WIDTH = 100
EVENTS_SHOWN = 10
LABEL_WIDTH = 17

_PHASE_ICONS = {
    AnalysisPhase.RUNNING: RUNNING,
    AnalysisPhase.SUCCESSFUL: PASSED,
    AnalysisPhase.FAILED: FAILED,
    AnalysisPhase.ERROR: FAILED,
    AnalysisPhase.INCONCLUSIVE: WARNING,
}


def age(since: datetime | str | None, now: datetime) -> str:
    """kubectl's ages (apimachinery's HumanDuration): 42s, 3m12s, 65m, 3h3m, 8h, 2d7h, 9d. `since` as status has it,
    or as another object's metadata and an event's RFC 3339 text."""
    moment = parse_timestamp(since) if isinstance(since, str) else since
    if moment is None:
        return "-"
    seconds = max(0, int((now - moment).total_seconds()))
    minutes, hours = seconds // 60, seconds // 3600
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    return f"{hours // 24}d"


def cut(text: str, width: int = MESSAGE_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Columns padded like kubectl's tables (the last column is not padded)."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        indent + "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]).rstrip()
        for row in rows
    ]


@dataclass(frozen=True)
class Parsed:
    """A KVPolicy as the plugin reads it: the typed model, or the status alone with why the spec did not parse."""

    name: str
    namespace: str
    created: str | None
    status: KVPolicyStatus
    spec: KVPolicySpec | None
    invalid: str | None = None

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Parsed:
        meta = raw.get("metadata") or {}
        name, namespace, created = (
            str(meta.get("name", "")),
            str(meta.get("namespace", "")),
            meta.get("creationTimestamp"),
        )
        try:
            policy = KVPolicy.model_validate(raw)
        except ValidationError as error:
            status = KVPolicyStatus.model_validate(raw.get("status") or {})
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            return cls(name, namespace, created, status, None, f"{first['msg']} at {where}")
        return cls(name, namespace, created, policy.status, policy.spec)

    @property
    def phase(self) -> Phase | None:
        return self.status.phase

    def paused(self) -> bool:
        return condition_holds(self.status.conditions, ConditionType.PAUSED)


def phase_icon(parsed: Parsed) -> str:
    phase = parsed.phase
    if parsed.paused():
        return PAUSED
    if phase in (Phase.PROMOTED, Phase.HELD_BF16):
        drifted = condition_holds(parsed.status.conditions, ConditionType.DRIFTED)
        return WARNING if drifted else PASSED
    if phase in (Phase.ROLLED_BACK, Phase.ROLLING_BACK):
        return FAILED
    return RUNNING


def kv_column(status: KVPolicyStatus) -> str:
    """What the target runs or will run: the decision's dtype once decided, the plan's while it runs."""
    if status.decision is not None and status.decision.kv_cache_dtype:
        return status.decision.kv_cache_dtype
    return status.plan.kv_cache_dtype.value if status.plan else "-"


# --------------------------------------------------------------------------------------------------------- get


def _field(label: str, value: str) -> str:
    return f"{label + ':':<{LABEL_WIDTH}}{value}"


def _gpu(parsed: Parsed) -> str:
    gpu = parsed.status.gpu
    if gpu is None:
        return "-"
    facts = [gpu.generation.value]
    if gpu.compute_capability:
        facts.append(f"cc {gpu.compute_capability}")
    facts.append(f"{gpu.nodes} node{'s' if gpu.nodes != 1 else ''}")
    if gpu.mixed:
        facts.append("mixed generations")
    return f"{gpu.product or gpu.generation.value} ({', '.join(facts)})"


def _plan_lines(plan: Plan) -> list[str]:
    lines = [_field("Plan", f"{plan.kv_cache_dtype.value} KV cache")]
    if plan.extra_args:
        lines.append(_field("  Arguments", " ".join(plan.extra_args)))
    if plan.image:
        lines.append(_field("  Image", plan.image))
    lines.append(_field("  Gates", ", ".join(plan.gates) or "none"))
    lines.append("  Reasons:")
    for reason in plan.reasons:
        icon = WARNING if reason.severity == Severity.WARNING else "·"
        lines.append(f"    {icon} {reason.code}: {cut(reason.message, 110)}")
    return lines


def _job_gate_line(name: str, result: GateResult | None, planned: bool, max_samples: int | None = None) -> str:
    if result is None:
        return f"  {name:<13} {NOT_PLANNED if not planned else RUNNING + ' pending'}"
    icon = _PHASE_ICONS[result.verdict.phase]
    parts = [f"  {name:<13} {icon} {result.verdict.value:<12}"]
    if result.recovery is not None:
        interval = ""
        if result.recovery_low is not None and result.recovery_high is not None:
            interval = f" [{result.recovery_low:.2f}, {result.recovery_high:.2f}]"
        parts.append(f"recovery {result.recovery:.3f}{interval}")
    if result.samples is not None:
        cap = f"/{max_samples}" if max_samples is not None else ""
        parts.append(f"{result.samples}{cap} samples per side")
    if result.length_tokens is not None:
        parts.append(f"at {result.length_tokens} tokens")
    if result.task is not None:
        form = f" ({result.prompt_format.value})" if result.prompt_format is not None else ""
        parts.append(f"task {result.task.value}{form}")
    if result.verdict != GateVerdict.RUNNING and result.reason:
        parts.append(f"({result.reason})")
    if result.job:
        parts.append(f"job {result.job}")
    return " ".join(parts)


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def profile_lines(profile: LengthProfileResult, indent: str = "    ") -> list[str]:
    """The accuracy gate's length profile: its AUC and shift finding, then one row per bucket (shared with the
    demo's report)."""
    shift = (
        f"{WARNING} systematic shift: canary below baseline in {profile.negative_buckets}/{len(profile.buckets)} "
        f"buckets (sign test p {profile.shift_p_value or 0:.2g}): calibrate the KV scales"
        if profile.systematic_shift
        else f"no systematic shift ({profile.negative_buckets}/{len(profile.buckets)} buckets below, sign test "
        f"p {'-' if profile.shift_p_value is None else format(profile.shift_p_value, '.2g')})"
    )
    summary = (
        f"{indent}Length profile: AUC canary {_score(profile.canary_auc)} / baseline {_score(profile.baseline_auc)} "
        f"(recovery {_score(profile.auc_recovery)}); {shift}"
    )
    rows = [["TOKENS", "CANARY", "BASELINE", "RECOVERY", "PROMPTS", "CANARY-ONLY", "BASELINE-ONLY"]]
    rows += [
        [str(b.length_tokens), _score(b.canary_score), _score(b.baseline_score), _score(b.recovery), str(b.prompts),
         str(b.canary_only), str(b.baseline_only)]
        for b in profile.buckets
    ]  # fmt: skip
    return [summary, *table(rows, indent + "  ")]


def _latency_lines(parsed: Parsed, now: datetime) -> list[str]:
    spec, status = parsed.spec, parsed.status
    latency: LatencyAnalysis | None = status.latency
    planned = status.plan is not None and "Latency" in status.plan.gates
    if not planned or spec is None:
        return [f"  {'Latency':<13} {NOT_PLANNED}"]
    gate = spec.gates.latency
    if latency is None:
        return [f"  {'Latency':<13} {RUNNING} pending"]
    if latency.probe is not None:
        return [_job_gate_line("Latency probe", latency.probe, True)]
    passed = condition_holds(status.conditions, ConditionType.LATENCY_GATE_PASSED)
    failed = status.phase in (Phase.ROLLING_BACK, Phase.ROLLED_BACK) and latency.consecutive_failures > 0
    icon = PASSED if passed else FAILED if failed else RUNNING
    if latency.started_at is None:
        return [f"  {'Latency':<13} {RUNNING} waiting for the canary to join the traffic"]
    head = (
        f"  {'Latency':<13} {icon} {latency.checks} checks every {gate.interval_seconds}s over {gate.window_seconds}s "
        f"windows ({latency.passes} pass, {latency.breaches} breach, {latency.inconclusive} inconclusive; "
        f"{latency.consecutive_failures}/{gate.consecutive_failure_limit} breaches in a row)"
    )
    lines = [head]
    last = latency.last
    if last is not None:
        ratios = "  ".join(f"{key} {value:.3f}" for key, value in sorted(last.ratios.items()))
        limits = f"limits ttft {gate.ttft_max_ratio}, itl {gate.itl_max_ratio}"
        requests = ""
        if last.canary_requests is not None and last.baseline_requests is not None:
            requests = f"; {last.canary_requests} canary / {last.baseline_requests} baseline requests"
        lines.append(
            f"{'':16}last {last.verdict.value} {age(last.at, now)} ago: {ratios or last.reason} ({limits}{requests})"
        )
        if not passed and status.phase == Phase.LATENCY_ANALYSIS:
            started = latency.started_at
            if started is not None:
                baked = (now - started).total_seconds()
                left = max(0, spec.rollout.bake_seconds - int(baked))
                lines.append(f"{'':16}bake {spec.rollout.bake_seconds}s, {left}s left")
    return lines


def _traffic_lines(parsed: Parsed, now: datetime) -> list[str]:
    """Where the users' traffic goes: the route's step (traffic InferencePool) and the canary's share of the requests,
    intended and measured from the servers' own counters."""
    status, lines = parsed.status, []
    routed = status.traffic
    if routed is not None and parsed.spec is not None and parsed.spec.rollout.inference_pool is not None:
        routing = parsed.spec.rollout.inference_pool
        if routed.mirroring:
            where = f"{routing.mirror_percent}% of the requests mirrored to InferencePool {routed.canary_pool}"
            where += f", answered by {routed.pool} (mirror phase)"
        else:
            where = f"{routed.weight}% to InferencePool {routed.canary_pool}, {100 - routed.weight}% to {routed.pool}"
            where += f" (step {routed.step + 1} of {len(routing.steps)})"
        lines.append(_field("Route", f"HTTPRoute {routed.route}: {where}"))
    share = status.traffic_share
    if share is not None and status.phase == Phase.LATENCY_ANALYSIS:
        measured = f"{share.measured_percent:.1f}%" if share.measured_percent is not None else "-"
        lines.append(
            _field(
                "Canary share",
                f"measured {measured} of requests (intended {share.intended_percent:.1f}%): "
                f"{share.canary_requests:.0f} canary / {share.baseline_requests:.0f} baseline over "
                f"{share.window_seconds:.0f}s, {age(share.at, now)} ago",
            )
        )
    return ["", *lines] if lines else []


def _approval(parsed: Parsed) -> str | None:
    spec, status = parsed.spec, parsed.status
    if spec is None or spec.rollout.approval == Approval.AUTOMATIC:
        return None
    named = spec.rollout.approved_rollout
    if named is not None and named == status.rollout_id:
        return f"Manual: rollout {named} approved"
    if status.phase == Phase.AWAITING_APPROVAL:
        waiting = (
            f"Manual: waiting; run `kubectl kvpolicy approve {parsed.name}` (approves rollout {status.rollout_id})"
        )
        return waiting + (f"; approvedRollout names {named}" if named else "")
    return "Manual" + (f" (approvedRollout names an earlier rollout, {named})" if named else "")


def _on_drift(parsed: Parsed) -> str:
    spec = parsed.spec
    if spec is None:
        return "-"
    if spec.rollout.on_drift is not None:
        return spec.rollout.on_drift.value
    fp8 = parsed.status.decision is None or parsed.status.decision.result == DecisionResult.PROMOTED
    return f"{(OnDrift.REEVALUATE if fp8 else OnDrift.REPORT).value} (default)"


def _conditions(conditions: Sequence[Condition], now: datetime) -> list[str]:
    rows = [["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"]]
    rows += [[c.type, c.status, c.reason, age(c.last_transition_time, now), cut(c.message)] for c in conditions]
    return ["Conditions:", *table(rows, "  ")]


def _event_time(event: Mapping[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def _event_order(event: Mapping[str, Any]) -> tuple[str, int]:
    """By time, then by resourceVersion: the events of one step share a timestamp."""
    version = str((event.get("metadata") or {}).get("resourceVersion") or "")
    return _event_time(event), int(version) if version.isdigit() else 0


def _events(events: Sequence[Mapping[str, Any]], now: datetime) -> list[str]:
    recent = sorted(events, key=_event_order)[-EVENTS_SHOWN:]
    rows = [["AGE", "TYPE", "REASON", "MESSAGE"]]
    rows += [
        [
            age(_event_time(e), now),
            str(e.get("type", "")),
            str(e.get("reason", "")),
            cut(str(e.get("message", ""))),
        ]
        for e in recent
    ]
    return ["Events:", *table(rows, "  ")] if recent else ["Events:          <none>"]


def render_get(raw: Mapping[str, Any], events: Sequence[Mapping[str, Any]], now: datetime) -> str:
    """The `kubectl kvpolicy get NAME` view."""
    parsed = Parsed.of(raw)
    spec, status = parsed.spec, parsed.status
    lines = [_field("Name", parsed.name), _field("Namespace", parsed.namespace)]
    if spec is not None:
        container = spec.target_ref.container or "first container"
        lines.append(_field("Target", f"{spec.target_ref.kind.value}/{spec.target_ref.name} ({container})"))
    else:
        lines.append(_field("Spec", f"invalid: {parsed.invalid}"))
    phase = status.phase.value if status.phase else "Pending"
    since = f"  (for {age(status.phase_entered_at, now)})" if status.phase_entered_at else ""
    lines.append(_field("Status", f"{phase_icon(parsed)} {phase}{since}" + (" — paused" if parsed.paused() else "")))
    if status.message:
        lines.append(_field("Message", cut(status.message, 160)))
    if status.rollout_id:
        lines.append(
            _field(
                "Rollout",
                f"{status.rollout_id}  (generation {status.rollout_generation}, run {status.rollout_run or 1}, "
                f"started {age(status.rollout_started_at, now)} ago)",
            )
        )
    if spec is not None:
        mode = spec.rollout.apply_mode.value
        lines.append(_field("Apply mode", f"{mode}    On drift: {_on_drift(parsed)}"))
        approval = _approval(parsed)
        if approval:
            lines.append(_field("Approval", approval))
    lines.append(_field("GPU", _gpu(parsed)))
    if status.plan is not None:
        lines += ["", *_plan_lines(status.plan)]
    lines += ["", "Gates:"]
    gates = status.plan.gates if status.plan else []
    for gate in PHASE_GATES:
        cap = gate.sample_cap(spec) if spec is not None else None
        lines.append(_job_gate_line(gate.label, gate.result(status), gate.label in gates, cap))
        result = gate.result(status)
        if result is not None and result.profile is not None:
            lines += profile_lines(result.profile)
    lines += _latency_lines(parsed, now)
    lines += _traffic_lines(parsed, now)
    if status.decision is not None:
        decision = status.decision
        when = f"({age(decision.time, now)} ago)"
        summary = f"{decision.result.value}  {decision.reason}  {when}: {cut(decision.message, 120)}"
        lines += ["", _field("Decision", summary)]
    if status.drift is not None:
        lines.append(_field("Drift", f"since {age(status.drift.detected_at, now)} ago"))
        lines += [f"  {d.field}: {cut(d.expected, 60)} -> {cut(d.observed, 60)}" for d in status.drift.differences]
    if status.advice is not None and spec is not None and spec.rollout.apply_mode == ApplyMode.ADVISORY:
        advice = status.advice
        lines += [
            _field("Advice", f"for rollout {advice.rollout_id}: {cut(advice.summary, 120)}"),
            f"  kubectl patch deployment {advice.deployment} -n {parsed.namespace} --type strategic "
            f"-p '{advice.strategic_merge_patch}'",
        ]
    lines += ["", *_conditions(status.conditions, now), "", *_events(events, now)]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------------------- list


def render_list(items: Sequence[Mapping[str, Any]], now: datetime, all_namespaces: bool) -> str:
    header = ["NAME", "PHASE", "KV", "ROLLOUT", "GPU", "DECISION", "REASON", "AGE"]
    rows = [(["NAMESPACE"] if all_namespaces else []) + header]
    for raw in sorted(items, key=lambda r: ((r.get("metadata") or {}).get("namespace", ""), r["metadata"]["name"])):
        parsed = Parsed.of(raw)
        status = parsed.status
        phase = status.phase.value if status.phase else "Pending"
        row = [
            parsed.name,
            f"{phase_icon(parsed)} {phase}",
            kv_column(status),
            status.rollout_id or "-",
            status.gpu.product if status.gpu and status.gpu.product else "-",
            status.decision.result.value if status.decision else "-",
            status.decision.reason if status.decision else "-",
            age(parsed.created, now),
        ]
        rows.append(([parsed.namespace] if all_namespaces else []) + row)
    if len(rows) == 1:
        return "No KVPolicies found.\n"
    return "\n".join(table(rows)) + "\n"
