"""promtool validates the alert rules and runs their unit tests (monitoring/alerts_test.yaml), as `make test` does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed: `make prometheus` installs it")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120, check=False)


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", "alerts.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "alerts_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_and_a_runbook() -> None:
    groups = yaml.safe_load((MONITORING / "alerts.yaml").read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    tests = yaml.safe_load((MONITORING / "alerts_test.yaml").read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    names = {rule["alert"] for rule in rules}
    assert names == {
        "KVPolicyRolledBack",
        "KVPolicyRolloutStuck",
        "KVPolicyAccuracyRecoveryLow",
        "KVPolicyCanaryTTFTRegression",
        "KVPolicyOperatorAbsent",
        "KVPolicyReconcileErrors",
    }
    assert tested == names
    silent = {case["alertname"] for test in tests for case in test["alert_rule_test"] if not case["exp_alerts"]}
    assert silent == names
    for rule in rules:
        assert rule["annotations"]["runbook"].strip(), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_a_broken_rule_file_is_caught(tmp_path: Path) -> None:
    broken = tmp_path / "alerts.yaml"
    broken.write_text((MONITORING / "alerts.yaml").read_text().replace("time() >", "time( >", 1))
    result = promtool("check", "rules", str(broken))
    assert result.returncode != 0
