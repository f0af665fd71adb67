"""promtool validates the alert rules and runs their unit tests (monitoring/alerts_test.yaml), as `make test` does;
every alert follows the monitoring-mixins conventions and links a runbook section that exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RUNBOOKS = MONITORING / "runbooks.md"
RUNBOOK_URL = "https://github.com/kvpolicy/kvpolicy/blob/main/monitoring/runbooks.md#"
ALERTS = {
    "KVPolicyRolledBack",
    "KVPolicyRolloutStuck",
    "KVPolicyAwaitingApproval",
    "KVPolicyAnalysisStalled",
    "KVPolicyAccuracyRecoveryLow",
    "KVPolicyCanaryTTFTRegression",
    "KVPolicyCanaryITLRegression",
    "KVPolicyCanaryTrafficSkewed",
    "KVPolicyCanaryNoTraffic",
    "KVPolicyOperatorAbsent",
    "KVPolicyReconcileErrors",
    "KVPolicyOperatorCannotReachAPI",
    "KVPolicyOperatorNotActing",
}
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed: `make prometheus` installs it")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120, check=False)


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", "alerts.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "alerts_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((MONITORING / "alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load((MONITORING / "alerts_test.yaml").read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    silent = {case["alertname"] for test in tests for case in test["alert_rule_test"] if not case["exp_alerts"]}
    assert {rule["alert"] for rule in rules()} == ALERTS
    assert tested == ALERTS
    assert silent == ALERTS


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# What the operator heals by itself (monitoring-mixins: `info`, for dashboards and inhibition, not a page): a rollback
# has already returned the target to BF16, and the analysis rolls a regressing canary back after its breaches.
SELF_HEALING = {"KVPolicyRolledBack", "KVPolicyCanaryTTFTRegression", "KVPolicyCanaryITLRegression"}


def test_alerts_follow_the_monitoring_mixins_conventions() -> None:
    """A severity label (`info` exactly for the self-healing alerts); a static summary (no template: one text per
    alert, so that notifications group), description and runbook_url annotations, the URL naming a runbook section."""
    sections = {github_anchor(line[3:]) for line in RUNBOOKS.read_text().splitlines() if line.startswith("## ")}
    for rule in rules():
        name = rule["alert"]
        severity = rule["labels"]["severity"]
        assert severity == "info" if name in SELF_HEALING else severity in ("warning", "critical"), name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert annotations["summary"].endswith("."), name
        assert "{{" not in annotations["summary"] and "$" not in annotations["summary"], name
        assert annotations["runbook_url"] == RUNBOOK_URL + name.lower(), name
        assert name.lower() in sections, f"monitoring/runbooks.md has no section {name}"


def test_stuck_rollouts_are_aborted_not_deleted() -> None:
    """The operator recreates a deleted canary: the runbook and the alert say to set spec.rollout.abort."""
    [stuck] = [rule for rule in rules() if rule["alert"] == "KVPolicyRolloutStuck"]
    section = RUNBOOKS.read_text().split("## KVPolicyRolloutStuck", 1)[1].split("\n## ", 1)[0]
    for text in (stuck["annotations"]["description"], section):
        assert '{"spec":{"rollout":{"abort":true}}}' in text
        assert "kubectl delete" not in text


def test_a_broken_rule_file_is_caught(tmp_path: Path) -> None:
    broken = tmp_path / "alerts.yaml"
    broken.write_text((MONITORING / "alerts.yaml").read_text().replace("time() -", "time( -", 1))
    result = promtool("check", "rules", str(broken))
    assert result.returncode != 0
