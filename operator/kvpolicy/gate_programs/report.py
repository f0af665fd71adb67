"""A gate's result, the contract between the gate tools and the operator: one `GateReport` as compact JSON on stdout,
also in the pod's termination log (Kubernetes keeps at most 4 KiB), and an exit code.

Every gate writes it through `emit`; the operator reads it back with `read_report`, which never raises: a missing,
unreadable or oversized report is an Inconclusive report with a `REPORT_PROBLEMS` reason. The GPU probe
(`kvkernels.probe`, a separate distribution) writes the same JSON with its own writer; a contract test holds it to this
model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from kvpolicy.api.reasons import GateReason
from kvpolicy.api.v1alpha1 import AccuracyTask, AnalysisPhase, GateVerdict, LengthProfileResult, PromptFormat

TERMINATION_LOG_ENV = "KVPOLICY_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_LOG_LIMIT = 4096

# By what the verdict means (its phase); a gate tool reports no Running or Error (the operator's words for a Job
# without a report), which exit as an inconclusive one would.
_PHASE_EXIT_CODES = {AnalysisPhase.SUCCESSFUL: 0, AnalysisPhase.FAILED: 1, AnalysisPhase.INCONCLUSIVE: 2}
EXIT_CODES = {
    verdict: _PHASE_EXIT_CODES[verdict.phase] for verdict in GateVerdict if verdict.phase in _PHASE_EXIT_CODES
}


class GateReport(BaseModel):
    """What a gate concluded: a verdict, a CamelCase reason, a sentence, and the figures the operator records.
    Gate-specific figures beyond these (fits, per-length detail) ride along as extra camelCase keys."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    gate: str | None = None
    task: AccuracyTask | None = None  # the accuracy gate's
    prompt_format: PromptFormat | None = None  # the accuracy gate's, Auto resolved once it knows the servers
    verdict: GateVerdict
    reason: str = Field(default="", pattern=r"^([A-Za-z][A-Za-z0-9_]*)?$")
    message: str = ""
    length_tokens: int | None = None
    samples: int | None = None
    canary_score: float | None = None
    baseline_score: float | None = None
    recovery: float | None = None
    recovery_low: float | None = None
    recovery_high: float | None = None
    profile: LengthProfileResult | None = None  # the accuracy gate's length profile, when it sampled one

    @classmethod
    def problem(cls, reason: GateReason, message: str) -> GateReport:
        return cls(verdict=GateVerdict.INCONCLUSIVE, reason=reason, message=message)


def render(report: GateReport) -> str:
    """Compact JSON within the termination-log limit: shorten the message if needed."""
    document = report.model_dump(mode="json", by_alias=True, exclude_unset=True)
    text = json.dumps(document, separators=(",", ":"))
    overflow = len(text.encode()) - TERMINATION_LOG_LIMIT
    if overflow > 0:
        message = report.message
        document["message"] = message[: max(0, len(message) - overflow - 3)] + "..."
        text = json.dumps(document, separators=(",", ":"))
    return text


def termination_log_path() -> Path | None:
    configured = os.environ.get(TERMINATION_LOG_ENV)
    if configured:
        return Path(configured)
    return DEFAULT_TERMINATION_LOG if DEFAULT_TERMINATION_LOG.exists() else None


def emit(result: GateReport | Mapping[str, Any]) -> int:
    """Print the report, write the termination log, and return the exit code for its verdict. A gate's dict is held
    to the contract here: one that is no GateReport fails loudly in the gate, not silently in the operator."""
    report = result if isinstance(result, GateReport) else GateReport.model_validate(result)
    text = render(report)
    print(text, flush=True)
    path = termination_log_path()
    if path is not None:
        path.write_text(text)
    return EXIT_CODES.get(report.verdict, 2)


def _parse(text: str) -> GateReport | None:
    try:
        return GateReport.model_validate_json(text)
    except ValidationError:
        return None


def read_report(text: str | None) -> GateReport:
    """The report a gate's pod left in its termination message. With FallbackToLogsOnError the message may be the log
    tail, so the last line holding a report wins. Never raises."""
    if not text or not text.strip():
        return GateReport.problem(GateReason.REPORT_MISSING, "the gate wrote no report")
    size = len(text.encode())
    if size > TERMINATION_LOG_LIMIT:
        return GateReport.problem(
            GateReason.REPORT_TOO_LARGE,
            f"the gate's report is {size} bytes, over the {TERMINATION_LOG_LIMIT}-byte termination-message limit",
        )
    for line in reversed(text.strip().splitlines()):
        report = _parse(line)
        if report is not None:
            return report
    whole = _parse(text)
    if whole is not None:
        return whole
    return GateReport.problem(GateReason.REPORT_UNREADABLE, f"the gate's output is no report: {text.strip()[-200:]!r}")
