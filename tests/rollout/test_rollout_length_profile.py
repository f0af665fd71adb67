"""What the operator does with the accuracy gate's length profile: the decision at the gate's length stays the gate's;
a systematic shift behind a pass is a SystematicShift Warning and condition (onSystematicShift Warn, the default) or
a rollback (Fail); the profile is recorded in status.accuracy."""

from __future__ import annotations

import json
from typing import Any

from operator_helpers import Driver, make_policy, to_accuracy_gate

LENGTHS = [16384, 32768, 65536, 131072]


def report(verdict: str, reason: str, systematic: bool, recovery: float = 0.98) -> str:
    baseline_only = 6 if systematic else 1
    buckets = [
        {"lengthTokens": n, "prompts": 40, "needles": 320, "canaryScore": 0.9, "baselineScore": 0.92,
         "recovery": recovery, "canaryOnly": 0 if systematic else 1, "baselineOnly": baseline_only}
        for n in LENGTHS
    ]  # fmt: skip
    profile = {
        "buckets": buckets, "canaryAuc": 0.9, "baselineAuc": 0.92, "aucRecovery": 0.978,
        "systematicShift": systematic, "shiftPValue": 6e-8 if systematic else 0.5, "negativeBuckets": 4 if systematic
        else 0,
    }  # fmt: skip
    return json.dumps(
        {"gate": "accuracy", "verdict": verdict, "reason": reason, "recovery": recovery, "recoveryLow": 0.96,
         "recoveryHigh": 0.99, "lengthTokens": 131072, "samples": 40, "profile": profile}
    )  # fmt: skip


def judged(output: str, exit_code: int = 0, **spec: Any) -> Driver:
    driver = Driver(make_policy(**{"gates.accuracy.lengthProfile.buckets": 4, **spec}))
    to_accuracy_gate(driver)
    driver.world.finish_job("accuracy", output, exit_code=exit_code)
    driver.tick()
    return driver


def warnings(driver: Driver, reason: str) -> list[str]:
    return [e.message for r in driver.results for e in r.events if e.type == "Warning" and e.reason == reason]


def test_the_job_samples_the_specs_buckets() -> None:
    driver = Driver(make_policy(**{"gates.accuracy.lengthProfile.buckets": 4}))
    to_accuracy_gate(driver)
    command = driver.world.jobs["llama-fp8-accuracy-g1"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--length-buckets") + 1] == "4"


def test_a_systematic_shift_behind_a_pass_warns_and_the_rollout_goes_on() -> None:
    driver = judged(report("Pass", "RecoveryAboveThreshold", systematic=True))
    assert driver.phase == "LatencyAnalysis"
    assert driver.condition("AccuracyGatePassed") == ("True", "SystematicShift")
    [message] = warnings(driver, "SystematicShift")
    assert "below the baseline in all 4 length buckets" in message
    assert "calibrate them" in message and "kvCache.scales Calibrated" in message
    recorded = driver.policy.status.accuracy
    assert recorded is not None and recorded.profile is not None and recorded.profile.systematic_shift
    assert [bucket.length_tokens for bucket in recorded.profile.buckets] == LENGTHS


def test_on_systematic_shift_fail_rolls_a_passing_gate_back() -> None:
    output = report("Pass", "RecoveryAboveThreshold", systematic=True)
    driver = judged(output, **{"gates.accuracy.lengthProfile.onSystematicShift": "Fail"})
    assert driver.phase == "RollingBack"
    assert driver.policy.status.decision.reason == "AccuracySystematicShift"
    assert "systematic shift" in driver.policy.status.decision.message
    assert driver.condition("AccuracyGatePassed") == ("False", "SystematicShift")
    assert warnings(driver, "SystematicShift")


def test_a_profile_without_a_shift_passes_as_before() -> None:
    driver = judged(report("Pass", "RecoveryAboveThreshold", systematic=False))
    assert driver.phase == "LatencyAnalysis"
    assert driver.condition("AccuracyGatePassed") == ("True", "RecoveryAboveMinimum")
    assert "AccuracyGatePassed" in driver.reasons() and not warnings(driver, "SystematicShift")
    assert driver.policy.status.accuracy.profile is not None


def test_a_failing_gate_fails_on_its_own_decision_whatever_the_profile() -> None:
    output = report("Fail", "RecoveryBelowThreshold", systematic=True, recovery=0.5)
    driver = judged(output, exit_code=1, **{"gates.accuracy.lengthProfile.onSystematicShift": "Fail"})
    assert driver.phase == "RollingBack"
    assert driver.policy.status.decision.reason == "AccuracyRecoveryBelowMinimum"
    assert driver.condition("AccuracyGatePassed") == ("False", "RecoveryBelowMinimum")


def test_kubectl_kvpolicy_get_shows_each_bucket_and_the_shift() -> None:
    from datetime import UTC, datetime

    from kvpolicy.plugin import view

    driver = judged(report("Pass", "RecoveryAboveThreshold", systematic=True))
    policy = driver.policy
    raw = {"metadata": policy.metadata, "spec": policy.spec.to_k8s(), "status": policy.status.to_k8s()}
    screen = view.render_get(raw, [], datetime.now(UTC))
    assert "Length profile: AUC canary 0.900 / baseline 0.920 (recovery 0.978)" in screen
    assert "systematic shift: canary below baseline in 4/4 buckets (sign test p 6e-08)" in screen
    rows = [line.split() for line in screen.splitlines() if line.strip().startswith(tuple(map(str, LENGTHS)))]
    assert [row[0] for row in rows] == [str(n) for n in LENGTHS]
    assert rows[0][1:] == ["0.900", "0.920", "0.980", "40", "0", "6"]
