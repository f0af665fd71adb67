"""Reason codes have one home (kvpolicy/api/reasons.py): the README's reason tables, the alert runbooks, the planner
and the analysis are checked against it, and the controller compares no phase, verdict or reason as a string."""

from __future__ import annotations

import ast
import re
from enum import StrEnum
from pathlib import Path

import yaml
from kvpolicy.api.reasons import ALL_REASONS, DECISION_REASONS, AnalysisReason, PlanCode
from kvpolicy.api.v1alpha1 import ConditionType, DecisionResult, GateVerdict, Phase, Traffic
from kvpolicy.planning import planner

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "operator" / "kvpolicy"
CODE = re.compile(r"`([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)`")
CAMEL = re.compile(r"\b[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*[A-Z][A-Za-z0-9]*\b")
# Words in the runbooks that are Kubernetes', Prometheus' or a product's, not kvpolicy reasons.
NOT_REASONS = {
    *(
        "CrashLoopBackOff",
        "ClusterRole",
        "ServiceMonitor",
        "PrometheusRule",
        "NetworkPolicy",
        "LLM-Compressor",
        "KVPolicy",
    ),
}


def _reason_columns(markdown: str) -> list[tuple[str, set[str]]]:
    """(table header, codes) for each column of a README table whose header names a reason."""
    columns: list[tuple[str, set[str]]] = []
    lines = markdown.splitlines()
    for index, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and lines[index + 1].startswith("|---")):
            continue
        header = [cell.strip() for cell in line.strip("|").split("|")]
        rows = []
        for row in lines[index + 2 :]:
            if not row.startswith("|"):
                break
            rows.append([cell.strip() for cell in row.strip("|").split("|")])
        for position, title in enumerate(header):
            if "reason" in title:
                codes = {code for row in rows if position < len(row) for code in CODE.findall(row[position])}
                columns.append((line, codes))
    return columns


def test_the_readme_names_only_reasons_that_exist_and_every_decision_reason() -> None:
    columns = _reason_columns((ROOT / "README.md").read_text())
    assert len(columns) >= 3, "the planner, verdict and decision tables"
    documented = set().union(*(codes for _, codes in columns))
    assert documented - ALL_REASONS == set(), "README names reasons that kvpolicy/api/reasons.py does not have"
    assert DECISION_REASONS - documented == set(), "decision reasons missing from the README's decision table"
    analysis = {str(reason) for reason in AnalysisReason} - {"AnalysisPassed", "Baking", "AnalysisStalled"}
    assert analysis - documented == set(), "latency check reasons missing from the README's verdict table"


def test_the_alert_runbooks_name_only_reasons_that_exist() -> None:
    rules = (ROOT / "monitoring" / "alerts.yaml").read_text()
    alerts = {rule["alert"] for group in yaml.safe_load(rules)["groups"] for rule in group["rules"]}
    runbooks = (ROOT / "monitoring" / "runbooks.md").read_text()
    words = set(CAMEL.findall(rules + runbooks)) - alerts - NOT_REASONS
    known = ALL_REASONS | {*DecisionResult, *Phase, *GateVerdict, *Traffic, *ConditionType}
    assert words - known == set(), "alerts.yaml or runbooks.md name reasons that kvpolicy/api/reasons.py does not have"
    assert {"TTFTRatioExceeded", "ITLRatioExceeded", "AnalysisStalled"} <= words


def _reason_arguments(path: Path, functions: set[str]) -> list[ast.expr]:
    """The reasons passed to calls of `functions` in a module (their first argument; both arms of `a if c else b`)."""
    found: list[ast.expr] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in functions:
                first = node.args[0]
                found += [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
    # A parameter passed on (`self.say(code, ...)`) is typed as the enum: mypy holds it to a member.
    return [argument for argument in found if not isinstance(argument, ast.Name)]


def _members_of(enum: type[StrEnum], arguments: list[ast.expr]) -> set[str]:
    """The members of `enum` the arguments name; an argument that is anything else is shown as its source."""
    return {
        enum[argument.attr]
        if isinstance(argument, ast.Attribute)
        and isinstance(argument.value, ast.Name)
        and argument.value.id == enum.__name__
        and argument.attr in enum.__members__
        else ast.unparse(argument)
        for argument in arguments
    }


def test_the_planner_says_only_plan_codes() -> None:
    codes = _members_of(PlanCode, _reason_arguments(Path(planner.__file__), {"say", "refuse", "soft_bf16"}))
    assert codes and codes <= set(PlanCode)


def test_the_analysis_reasons_are_analysis_reasons() -> None:
    analysis = PACKAGE / "analysis"
    errors = {"ProviderUnavailableError", "QueryRejectedError"}
    raised = _members_of(
        AnalysisReason, [arg for path in analysis.glob("*.py") for arg in _reason_arguments(path, errors)]
    )
    assert raised and raised <= set(AnalysisReason)


# Kubernetes' own reasons that share a value with one of ours: the API server's for a 409, the scheduler's PodScheduled.
KUBERNETES_REASONS = {("kube/executor.py", "Conflict"), ("kube/observe.py", "Unschedulable")}


def _reason_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants (docstrings aside) that spell a reason instead of naming its member."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    formatted = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    spelled = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in ALL_REASONS
        and id(node) not in docstrings
        and id(node) not in formatted
    ]
    # A reason built from pieces (f"No{role}Series"): an f-string that starts with a capitalised word and whose text
    # parts are all single words.
    built = [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        and isinstance(node.values[0], ast.Constant)
        and str(node.values[0].value)[:1].isupper()
        and (parts := [part.value for part in node.values if isinstance(part, ast.Constant)])
        and all(re.fullmatch(r"[A-Za-z0-9]+", str(part)) for part in parts)
    ]
    return spelled + built


def test_no_reason_is_a_string_literal_outside_the_api() -> None:
    offenders = {
        f"{name}:{line} {value!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not (name := path.relative_to(PACKAGE).as_posix()).startswith("api/")
        for line, value in _reason_literals(ast.parse(path.read_text()))
        if (name, value) not in KUBERNETES_REASONS
    }
    assert offenders == set()


def test_the_reason_literal_check_catches_a_spelled_or_built_reason() -> None:
    tree = ast.parse('"""A docstring naming Baking."""\nraise GateError("MalformedResponse", f"{x}: Baking")')
    assert _reason_literals(tree) == [(2, "MalformedResponse")]
    built = ast.parse('reason = f"No{side.role.capitalize()}Series"\nmessage = f"No series for {side.role}"')
    assert _reason_literals(built) == [(1, "f'No{side.role.capitalize()}Series'")]


# Values the controller must never spell as string literals in a comparison.
CONTRACT_VALUES = ALL_REASONS | {*Phase, *GateVerdict, *DecisionResult}


def _literal_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            elements = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
            for element in elements:
                if isinstance(element, ast.Constant) and element.value in CONTRACT_VALUES:
                    found.append((node.lineno, str(element.value)))
    return found


def test_the_controller_compares_no_phase_verdict_or_reason_as_a_string() -> None:
    offenders = {
        f"{path.name}:{line} {value!r}"
        for room in ("rollout", "kube", "runtime", "notify")
        for path in sorted((PACKAGE / room).glob("*.py"))
        for line, value in _literal_comparisons(ast.parse(path.read_text()))
    }
    assert offenders == set()


def test_the_literal_check_catches_a_string_comparison() -> None:
    tree = ast.parse('if phase == "Promoted" or verdict in ("Running", "Pass") or reason != "Aborted": pass')
    assert [value for _, value in _literal_comparisons(tree)] == ["Promoted", "Running", "Pass", "Aborted"]
