"""The demo's Markdown report: the decision table, what each policy's status says, and the simulator's figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kvpolicy.api.v1alpha1 import GateResult, KVPolicy, LatencyCheck, LengthProfileResult

from kvpolicy_dev.demo.figures import ACCURACY_FIGURE, ITL_FIGURE
from kvpolicy_dev.demo.scenarios import Scenario
from kvpolicy_dev.demo.table import decision_rows, render_markdown

REPORT_FILE = "report.md"
POLICIES_FILE = "kvpolicies.yaml"
DEPLOYMENTS_FILE = "deployments.yaml"


RATIO_NOTE = (
    "TTFT and ITL ratios are the largest canary/baseline ratio the last latency check compared, estimated by "
    "`histogram_quantile` from vLLM's histograms. vLLM's buckets are fixed (its first ITL bucket ends at 10 ms): when "
    "both sides' quantiles fall in one bucket the quantile cannot show a difference, so the check compares the means "
    "(rate of `_sum` over rate of `_count`) instead and says so in its message."
)


@dataclass(frozen=True)
class Observed:
    """What the cluster showed at the end of the run: the KVPolicies, their events, the Deployments they target, and
    (real model only) each policy's accuracy gate progress, one line per prompt as the gate Job logged it."""

    policies: Sequence[Mapping[str, Any]]
    events: Mapping[str, Sequence[str]] = field(default_factory=dict)
    deployments: Sequence[Mapping[str, Any]] = ()
    accuracy_prompts: Mapping[str, Sequence[str]] = field(default_factory=dict)


SIMULATED_SERVERS = (
    "The cluster, the GPUs and vLLM are emulated: the simulators' accuracy follows emulated FP8 accumulation and their "
    "latency the published fits, scaled in time."
)
REAL_VLLM_SERVERS = (
    "The cluster and the GPUs are emulated; the model pods ran real vLLM 0.32.0 (its CPU build, scenarios two at a "
    "time) serving a real model, SmolLM2-135M-Instruct, with every scenario's lengths scaled to its 8,192 positions: "
    "the users' requests, the pods' /metrics, Prometheus' histograms, every latency ratio and every accuracy score "
    "below are real vLLM's and that model's, measured on this CPU. So the accuracy verdicts judge FP8 KV on this "
    "model and CPU, not the FP8 accumulation of the GPUs the scenarios name (the simulators' story)."
)


@dataclass(frozen=True)
class RunFacts:
    """How the run went, for the report's header."""

    started_at: str
    duration_seconds: float
    machine: str
    latency_source: str
    mode: str
    user_requests: int = 0
    failed_user_requests: int = 0
    servers: str = SIMULATED_SERVERS  # what the model pods ran, and so where each number comes from


def _gate_lines(title: str, gate: GateResult | None) -> list[str]:
    if gate is None:
        return []
    parts = [f"**{gate.verdict}**"]
    if gate.recovery is not None:
        interval = ""
        if gate.recovery_low is not None and gate.recovery_high is not None:
            interval = f" (interval {gate.recovery_low:.2f}-{gate.recovery_high:.2f})"
        parts.append(f"recovery {gate.recovery:.2f}{interval}")
    if gate.canary_score is not None and gate.baseline_score is not None:
        form = f", {gate.prompt_format.value}" if gate.prompt_format is not None else ""
        task = f" ({gate.task.value}{form})" if gate.task is not None else ""
        parts.append(f"NIAH{task} canary {gate.canary_score:.0%} vs baseline {gate.baseline_score:.0%}")
    if gate.length_tokens is not None:
        parts.append(f"at {gate.length_tokens:,} tokens")
    if gate.samples is not None:
        parts.append(f"{gate.samples} samples")
    line = f"- {title}: " + ", ".join(parts)
    return [line + (f" — {gate.message}" if gate.message else ""), *_profile_lines(gate.profile)]


def _profile_lines(profile: LengthProfileResult | None) -> list[str]:
    """The accuracy gate's length profile: a table of its buckets, the AUC, and the shift finding."""
    if profile is None:
        return []

    def score(value: float | None, form: str = ".0%") -> str:
        return "-" if value is None else format(value, form)

    auc = f"AUC canary {score(profile.canary_auc)} vs baseline {score(profile.baseline_auc)}"
    shift = (
        f"**systematic shift**: the canary is below the baseline in every bucket (sign test p = "
        f"{profile.shift_p_value:.2g}): calibrate the KV scales"
        if profile.systematic_shift
        else f"no systematic shift ({profile.negative_buckets} of {len(profile.buckets)} buckets below)"
    )
    rows = [
        f"  | {b.length_tokens:,} | {score(b.canary_score)} | {score(b.baseline_score)} | {score(b.recovery, '.2f')} "
        f"| {b.prompts} | {b.canary_only} / {b.baseline_only} |"
        for b in profile.buckets
    ]
    return [
        f"  - Length profile: {auc} (recovery {score(profile.auc_recovery, '.2f')}); {shift}",
        "",
        "  | tokens | NIAH canary | NIAH baseline | recovery | prompts | needles only canary / only baseline |",
        "  |---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _latency_lines(check: LatencyCheck | None, checks: int, passes: int) -> list[str]:
    if check is None:
        return []
    ratios = ", ".join(f"{key} {value:.2f}" for key, value in sorted(check.ratios.items()))
    requests = ""
    if check.canary_requests is not None and check.baseline_requests is not None:
        requests = f"; requests canary {check.canary_requests}, baseline {check.baseline_requests}"
    return [
        f"- Latency analysis: {passes} passing of {checks} checks; last **{check.verdict}** "
        f"({ratios or 'no ratios'}{requests})" + (f" — {check.message}" if check.message else "")
    ]


def serving(policy: KVPolicy, deployments: Sequence[Mapping[str, Any]]) -> str | None:
    """What the policy's target Deployment runs now: its model container's image and arguments."""
    ref = policy.spec.target_ref
    for deployment in deployments:
        if deployment["metadata"]["name"] != ref.name:
            continue
        containers = deployment["spec"]["template"]["spec"].get("containers") or []
        chosen = next((c for c in containers if c.get("name") == ref.container), containers[0] if containers else None)
        if chosen is None:
            return None
        words = [str(word) for word in (chosen.get("command") or []) + (chosen.get("args") or [])]
        return f"image `{chosen.get('image', '?')}`, `{' '.join(words)}`"
    return None


def policy_section(
    policy: KVPolicy,
    scenario: Scenario | None,
    events: Sequence[str],
    now_serving: str | None,
    accuracy_prompts: Sequence[str] = (),
) -> str:
    name = str(policy.metadata.get("name", "?"))
    status = policy.status
    lines = [f"### {name}", ""]
    if scenario is not None:
        lines += [f"*{scenario.title}* — pool `{scenario.pool}`, model `{scenario.served_model_name}`", ""]
    if status.gpu is not None:
        lines.append(f"- GPU: {status.gpu.generation.value} — {status.gpu.message}")
    if status.plan is not None:
        plan = status.plan
        image = f", image `{plan.image}`" if plan.image else ""
        args = f", args `{' '.join(plan.extra_args)}`" if plan.extra_args else ""
        lines.append(f"- Plan: **{plan.kv_cache_dtype.value}**{image}{args}")
        lines += [f"  - `{reason.code}`: {reason.message}" for reason in plan.reasons]
    lines += _gate_lines("Accuracy gate", status.accuracy)
    if accuracy_prompts:
        lines += ["", "<details><summary>Accuracy gate, prompt by prompt (its Job's log)</summary>", "", "```",
                  *accuracy_prompts, "```", "", "</details>", ""]  # fmt: skip
    if status.latency is not None:
        lines += _latency_lines(status.latency.last, status.latency.checks, status.latency.passes)
    if status.decision is not None:
        decision = status.decision
        message = f" — {decision.message}" if decision.message else ""
        lines.append(f"- Decision: **{decision.result}** (`{decision.reason}`){message}")
    else:
        lines.append(
            f"- No decision: phase {status.phase or 'Pending'}" + (f" — {status.message}" if status.message else "")
        )
    if now_serving is not None:
        lines.append(f"- {policy.spec.target_ref.name} now runs {now_serving}")
    if events:
        lines += ["", "<details><summary>Events</summary>", "", *[f"- {event}" for event in events], "", "</details>"]
    return "\n".join(lines)


def policy_events(events: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Event lines per KVPolicy name, oldest first, from core/v1 Event objects."""
    result: dict[str, list[str]] = {}
    ordered = sorted(events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    for event in ordered:
        involved = event.get("involvedObject") or {}
        if involved.get("kind") != "KVPolicy":
            continue
        when = str(event.get("lastTimestamp") or event.get("eventTime") or "")
        line = f"{when} {event.get('type', 'Normal')} {event.get('reason', '')}: {event.get('message', '')}"
        result.setdefault(str(involved.get("name")), []).append(line.strip())
    return result


def _figure_lines(figures: Mapping[str, Any] | None) -> list[str]:
    if figures is None:
        return ["*The figures could not be drawn; see logs/figures.log in this folder.*"]
    lines = [
        "### NIAH accuracy against context length",
        "",
        "Expected accuracy of the simulated Llama-3.1-8B: the model's own retrieval curve times the survival of the "
        "emulated attention numerics. Hopper's truncating FP8 accumulator loses the needles past ~32k tokens; "
        "two-level accumulation and Blackwell track BF16.",
        "",
        f"![NIAH accuracy against context length]({ACCURACY_FIGURE})",
        "",
        "### Inter-token latency against input length",
        "",
        "Mean ITL of simulated requests (concurrency 1, 128 output tokens) with least-squares lines. FP8 reads half "
        "the KV bytes per step (smaller slope) but pays a fixed cost per step (larger intercept): it decodes faster "
        "only past the break-even length.",
        "",
        f"![ITL against input length]({ITL_FIGURE})",
        "",
    ]
    for panel in figures.get("itl", []):
        crossing = panel.get("breakEvenTokens")
        where = f"{crossing:,.0f} tokens" if crossing else "none"
        lines.append(f"- {panel['title']}: break-even {where}")
    return lines


def report_markdown(
    facts: RunFacts, observed: Observed, scenarios: Sequence[Scenario], figures: Mapping[str, Any] | None
) -> str:
    policies = [KVPolicy.model_validate(obj) for obj in observed.policies]
    by_name = {scenario.name: scenario for scenario in scenarios}
    sections = []
    for policy in policies:
        name = str(policy.metadata.get("name"))
        now_serving = serving(policy, observed.deployments)
        prompts = observed.accuracy_prompts.get(name, [])
        sections.append(policy_section(policy, by_name.get(name), observed.events.get(name, []), now_serving, prompts))
    header = [
        "# kvpolicy demo report",
        "",
        f"Run at {facts.started_at} on {facts.machine}, {facts.mode}, in {facts.duration_seconds:.0f} s. "
        f"Latency source: {facts.latency_source}. Users sent {facts.user_requests:,} requests, "
        f"{facts.failed_user_requests:,} of them failed.",
        "",
        f"Every row below is read from a KVPolicy's status as the operator wrote it. {facts.servers}",
        "",
        "## Decisions",
        "",
        render_markdown(decision_rows(observed.policies)),
        "",
        RATIO_NOTE,
        "",
        "## Policies",
        "",
    ]
    tail = [
        "",
        "## The simulator's models",
        "",
        *_figure_lines(figures),
        "",
        f"The final KVPolicies: [{POLICIES_FILE}]({POLICIES_FILE}); the Deployments they govern: "
        f"[{DEPLOYMENTS_FILE}]({DEPLOYMENTS_FILE})",
        "",
    ]
    return "\n".join(header) + "\n" + "\n\n".join(sections) + "\n" + "\n".join(tail)


def write_report(
    directory: Path,
    facts: RunFacts,
    observed: Observed,
    scenarios: Sequence[Scenario],
    figures: Mapping[str, Any] | None,
) -> Path:
    """report.md, plus the final KVPolicies and target Deployments as YAML beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, objects in ((POLICIES_FILE, observed.policies), (DEPLOYMENTS_FILE, observed.deployments)):
        (directory / name).write_text(yaml.safe_dump_all([dict(obj) for obj in objects], sort_keys=False))
    path = directory / REPORT_FILE
    path.write_text(report_markdown(facts, observed, scenarios, figures))
    return path
