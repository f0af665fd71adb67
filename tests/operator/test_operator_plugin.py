"""`kubectl kvpolicy`: the real kubectl binary finds the plugin's console script on PATH and runs it against the dev
cluster, with the operator rolling policies out under kopf."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_helpers import (
    KUBECTL,
    KVP,
    ROOT,
    OperatorFactory,
    kubectl,
    kubectl_run,
    policy,
    target,
    wait_phase,
    wait_until,
)
from kvpolicy import __version__
from kvpolicy.api.exit_codes import EXIT_FAILED, EXIT_INCONCLUSIVE, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from kvpolicy.plugin.cli import CLEAR_SCREEN
from kvpolicy.rollout.tick import CANARY_PHASES
from kvpolicy_dev.devcluster import ThreadedDevCluster

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl missing: run `make tools`")
SCRIPT = "kubectl-kvpolicy"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PATH with the `kubectl-kvpolicy` console script, written as pip writes one from pyproject's entry point."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][SCRIPT]
    module, function = entry.split(":")
    bin_dir = tmp_path_factory.mktemp("bin")
    script = bin_dir / SCRIPT
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nif __name__ == '__main__':\n"
        f"    sys.exit({function}())\n"
    )
    script.chmod(0o755)
    paths = [str(ROOT / "operator"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": os.pathsep.join(paths)}


def plugin(cluster: ThreadedDevCluster, env: dict[str, str], *args: str) -> str:
    return kubectl(cluster, "kvpolicy", *args, env=env)


@dataclass
class Screen:
    """A process writing to a pseudo-terminal, and everything it wrote."""

    process: subprocess.Popen[bytes]
    output: bytearray
    reader: threading.Thread

    def text(self) -> str:
        return bytes(self.output).decode(errors="replace")

    def frames(self) -> list[str]:
        return [frame for frame in self.text().replace("\r\n", "\n").split(CLEAR_SCREEN) if frame.strip()]


def on_a_terminal(cluster: ThreadedDevCluster, env: dict[str, str], *args: str) -> Screen:
    assert KUBECTL is not None
    primary, secondary = pty.openpty()
    environ = {**os.environ, **env, **cluster.environ(), "HOME": str(cluster.kubeconfig.parent), "TERM": "xterm"}
    process = subprocess.Popen([KUBECTL, *args], stdout=secondary, stderr=secondary, env=environ)
    os.close(secondary)
    output = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            output.extend(chunk)
        os.close(primary)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return Screen(process, output, reader)


@pytest.fixture
def screens() -> Iterator[list[Screen]]:
    started: list[Screen] = []
    yield started
    for screen in started:
        if screen.process.poll() is None:
            screen.process.kill()
        screen.process.wait(10)
        screen.reader.join(10)


def test_kubectl_finds_the_plugin(devcluster: ThreadedDevCluster, plugin_env: dict[str, str]) -> None:
    listed = kubectl_run(devcluster, "plugin", "list", env=plugin_env)
    assert SCRIPT in listed.stdout, listed.stderr
    assert "watch and steer KVPolicy rollouts" in plugin(devcluster, plugin_env, "--help")


def test_watch_approve_and_an_approval_that_does_not_carry_over(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    fixed_image_runner: None,
    plugin_env: dict[str, str],
    screens: list[Screen],
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns, **{"rollout.approval": "Manual"}))
        screen = on_a_terminal(
            devcluster, plugin_env, "kvpolicy", "get", "llama-fp8", "-n", ns, "--watch", "--interval", "1",
            "--timeout", "120",
        )  # fmt: skip
        screens.append(screen)
        waiting = wait_phase(devcluster, ns, {"AwaitingApproval"})
        first = waiting["status"]["rolloutId"]
        wait_until(lambda: any("AwaitingApproval  (for" in f for f in screen.frames()), "the view to show it")
        approved = plugin(devcluster, plugin_env, "approve", "llama-fp8", "-n", ns)
        assert approved.strip() == f"kvpolicy 'llama-fp8' rollout {first} approved"
        wait_phase(devcluster, ns, {"Promoted"})
        wait_until(lambda: "Promoted  (for" in screen.frames()[-1], "the view to show the promotion")
        screen.process.terminate()  # what Ctrl-C does to a watch

        # A new rollout (a spec edit): the approval of the first one stays in the spec and approves nothing.
        devcluster.patch(*KVP, "llama-fp8", {"spec": {"gates": {"accuracy": {"minRecovery": "0.96"}}}}, ns)
        again = wait_until(
            lambda: (
                (found := devcluster.get(*KVP, "llama-fp8", ns))["status"].get("rolloutId") != first
                and found["status"].get("phase") == "AwaitingApproval"
                and found
            ),
            "the second rollout to wait for its approval",
            timeout=90,
        )
        second = again["status"]["rolloutId"]
        assert again["spec"]["rollout"]["approvedRollout"] == first
        shown = plugin(devcluster, plugin_env, "get", "llama-fp8", "-n", ns)
        assert f"approves rollout {second}" in shown and f"approvedRollout names {first}" in shown
        plugin(devcluster, plugin_env, "approve", "llama-fp8", "-n", ns)
        done = wait_phase(devcluster, ns, {"Promoted"})
    assert done["status"]["rolloutId"] == second
    screen.process.wait(10)
    screen.reader.join(10)
    frames = screen.frames()
    assert len(frames) >= 3, "the view was redrawn as the rollout moved on"
    waiting_frame = next(f for f in frames if "AwaitingApproval  (for" in f)
    for part in ("Plan:", "FP8 KV cache", "Accuracy      ✔ Pass", "samples per side", "Conditions:", "Events:"):
        assert part in waiting_frame, part
    capture = os.environ.get("KVPOLICY_CAPTURE_DIR")  # the README's screen comes from here
    if capture:
        (Path(capture) / "kubectl-kvpolicy-watch.txt").write_text(waiting_frame)


def test_pause_resume_abort_retry_list_and_explain(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    operator: OperatorFactory,
    fixed_image_runner: None,
    plugin_env: dict[str, str],
) -> None:
    ns = devcluster_namespace
    devcluster.create(target(ns))
    with operator():
        devcluster.create(policy(ns))
        wait_phase(devcluster, ns, {"CanaryStarting", "AccuracyGate"})
        assert plugin(devcluster, plugin_env, "pause", "llama-fp8", "-n", ns).strip() == "kvpolicy 'llama-fp8' paused"
        wait_until(lambda: "paused" in plugin(devcluster, plugin_env, "get", "llama-fp8", "-n", ns), "the pause")
        held = devcluster.get(*KVP, "llama-fp8", ns)["status"]["phase"]
        plugin(devcluster, plugin_env, "resume", "llama-fp8", "-n", ns)
        plugin(devcluster, plugin_env, "abort", "llama-fp8", "-n", ns)
        aborted = wait_phase(devcluster, ns, {"RolledBack"})
        assert aborted["status"]["decision"]["reason"] == "Aborted"
        retried = plugin(devcluster, plugin_env, "retry", "llama-fp8", "-n", ns)
        assert retried.strip() == f"kvpolicy 'llama-fp8' rollout {aborted['status']['rolloutId']} retried"
        done = wait_phase(devcluster, ns, {"Promoted"})
        listed = plugin(devcluster, plugin_env, "list", "-A")
        explained = plugin(devcluster, plugin_env, "explain", "llama-fp8", "-n", ns)
    # Under load the rollout may reach a later canary phase before the pause lands; it must hold in one.
    assert held in {phase.value for phase in CANARY_PHASES}
    reasons = [e["reason"] for e in devcluster.list("v1", "Event", ns)]
    assert {"RolloutPaused", "RolloutResumed", "RollingBack", "RolloutRestarted"} <= set(reasons)
    assert done["status"]["rolloutId"] != aborted["status"]["rolloutId"]
    row = next(line for line in listed.splitlines() if line.startswith(ns))
    assert row.split()[1:5] == ["llama-fp8", "✔", "Promoted", "FP8"]
    assert "NVIDIA-H200 (Hopper, ComputeCapability)" in explained
    assert "TwoLevelAccumulationImage" in explained
    assert f"Same plan as the operator's in status (rollout {done['status']['rolloutId']})" in explained


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["get", "nothing-here"], "error: kvpolicy nothing-here not found in namespace"),
        (["approve", "llama-fp8"], "promotes without approval (spec.rollout.approval is Automatic)"),
        (["retry", "llama-fp8"], "only a RolledBack rollout can be retried"),
    ],
)
def test_refusals_say_why_without_a_traceback(
    devcluster: ThreadedDevCluster,
    devcluster_namespace: str,
    kvpolicy_crd: None,
    plugin_env: dict[str, str],
    args: list[str],
    error: str,
) -> None:
    devcluster.create(policy(devcluster_namespace))
    result = kubectl_run(devcluster, "kvpolicy", *args, "-n", devcluster_namespace, env=plugin_env)
    assert result.returncode == 1
    assert error in result.stderr and "Traceback" not in result.stderr


def test_resume_of_a_policy_never_paused_says_so_and_writes_nothing(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, kvpolicy_crd: None, plugin_env: dict[str, str]
) -> None:
    created = devcluster.create(policy(devcluster_namespace))
    result = kubectl_run(devcluster, "kvpolicy", "resume", "llama-fp8", "-n", devcluster_namespace, env=plugin_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "kvpolicy 'llama-fp8' is not paused: nothing to do"
    stored = devcluster.get(*KVP, "llama-fp8", devcluster_namespace)
    assert stored["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


def run_script(plugin_env: dict[str, str], tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **plugin_env, "HOME": str(tmp_path), **env}
    return subprocess.run([SCRIPT, *args], env=environ, capture_output=True, text=True, timeout=60, check=False)


def test_without_a_kubeconfig_the_plugin_says_what_to_set(plugin_env: dict[str, str], tmp_path: Path) -> None:
    result = run_script(plugin_env, tmp_path, "list", KUBECONFIG=str(tmp_path / "missing"))
    assert result.returncode == EXIT_UNAVAILABLE == 69
    assert "no usable kubeconfig" in result.stderr and "KUBECONFIG" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("apiVersion: v1\nclusters: [\n", "not YAML: expected the node content, but found '<stream end>' at line 3"),
        ("apiVersion: v1\ncontexts: 5\ncurrent-context: x\n", "not a kubeconfig (TypeError: "),
        ("just a string\n", "not a kubeconfig (TypeError: "),
        ("", "not a kubeconfig (TypeError: "),
        (
            "apiVersion: v1\nclusters:\n- name: c\n  cluster: {server: 'https://1.2.3.4', certificate-authority-data: "
            "'!!notbase64'}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n"
            "users:\n- name: u\n  user: {token: t}\n",
            "Invalid base64-encoded string",
        ),
    ],
)
def test_a_malformed_kubeconfig_is_one_line_without_a_traceback(
    plugin_env: dict[str, str], tmp_path: Path, content: str, problem: str
) -> None:
    """Issue 23 item 11: each of these traced back in `kubectl kvpolicy` (yaml, TypeError, binascii errors)."""
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(content)
    result = run_script(plugin_env, tmp_path, "--kubeconfig", str(kubeconfig), "get", "x")
    assert result.returncode == EXIT_UNAVAILABLE, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: no usable kubeconfig ({kubeconfig}: ") and problem in line, line


def test_version_needs_no_cluster_and_usage_errors_exit_64(plugin_env: dict[str, str], tmp_path: Path) -> None:
    text = run_script(plugin_env, tmp_path, "version", KUBECONFIG=str(tmp_path / "missing"))
    assert (text.returncode, text.stdout) == (0, f"kubectl-kvpolicy {__version__} (kvpolicy.dev/v1alpha1)\n")
    as_json = json.loads(run_script(plugin_env, tmp_path, "version", "-o", "json").stdout)
    assert as_json == {"plugin": "kubectl-kvpolicy", "version": __version__, "apiVersion": "kvpolicy.dev/v1alpha1"}
    for argv in (["status"], ["get", "x", "-o", "yaml"], ["frobnicate"]):
        result = run_script(plugin_env, tmp_path, *argv)
        assert result.returncode == EXIT_USAGE == 64, argv
        assert "Traceback" not in result.stderr


def decided(phase: str, result: str, reason: str, generation: int = 1) -> dict[str, object]:
    decision = {"result": result, "reason": reason, "message": f"{reason} in the test", "time": "2026-12-02T08:00:00Z"}
    return {"status": {"phase": phase, "observedGeneration": generation, "rolloutId": "1-abc", "decision": decision}}


def test_status_waits_for_the_current_specs_decision_and_exits_by_it(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, kvpolicy_crd: None, plugin_env: dict[str, str]
) -> None:
    """`kubectl kvpolicy status` for CI (issue 23 item 11): 2 when --timeout ends before a decision, 1 once the
    rollout rolled back, 0 for a promotion; a decision the operator took for an earlier generation is no answer."""
    ns = devcluster_namespace
    devcluster.create(policy(ns))

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return kubectl_run(devcluster, "kvpolicy", "status", "llama-fp8", "-n", ns, *args, env=plugin_env)

    def write_status(body: dict[str, object]) -> None:
        devcluster.patch(*KVP, "llama-fp8", body, ns, subresource="status")

    write_status({"status": {"phase": "AccuracyGate", "observedGeneration": 1, "message": "accuracy gate running"}})
    undecided = status("--timeout", "1", "--interval", "0.2")
    assert undecided.returncode == EXIT_INCONCLUSIVE == 2, undecided.stderr
    assert undecided.stdout == "kvpolicy 'llama-fp8' not decided within 1 s: AccuracyGate\n"
    assert "kvpolicy 'llama-fp8' AccuracyGate: accuracy gate running" in undecided.stderr

    assert KUBECTL is not None
    environ = {**os.environ, **plugin_env, **devcluster.environ(), "HOME": str(devcluster.kubeconfig.parent)}
    command = [KUBECTL, "kvpolicy", "status", "llama-fp8", "-n", ns, "--timeout", "60", "--interval", "0.5"]
    waiting = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert waiting.stderr is not None
        # Its first line says it waits (AccuracyGate): only then is the decision written.
        assert "kvpolicy 'llama-fp8' AccuracyGate: accuracy gate running" in waiting.stderr.readline()
        write_status(decided("RolledBack", "RolledBack", "AccuracyRecoveryBelowMinimum"))
        out, _ = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == EXIT_FAILED == 1
    assert (
        out
        == "kvpolicy 'llama-fp8' RolledBack (AccuracyRecoveryBelowMinimum): AccuracyRecoveryBelowMinimum in the test\n"
    )

    write_status(decided("Promoted", "Promoted", "GatesPassed", generation=0))  # an earlier spec's decision
    assert status("--timeout", "1", "--interval", "0.2").returncode == EXIT_INCONCLUSIVE
    write_status(decided("Promoted", "Promoted", "GatesPassed"))
    promoted = status("-o", "json")
    assert promoted.returncode == EXIT_OK, promoted.stderr
    report = json.loads(promoted.stdout)
    assert (report["result"], report["reason"], report["decided"], report["generation"]) == (
        "Promoted",
        "GatesPassed",
        True,
        1,
    )


def test_get_and_list_print_json(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, kvpolicy_crd: None, plugin_env: dict[str, str]
) -> None:
    ns = devcluster_namespace
    devcluster.create(policy(ns))
    got = json.loads(plugin(devcluster, plugin_env, "get", "llama-fp8", "-n", ns, "-o", "json"))
    assert (got["kind"], got["metadata"]["name"], got["spec"]["targetRef"]["name"]) == (
        "KVPolicy",
        "llama-fp8",
        "llama",
    )
    listed = json.loads(plugin(devcluster, plugin_env, "list", "-n", ns, "-o", "json"))
    assert [item["metadata"]["name"] for item in listed["items"]] == ["llama-fp8"]


@pytest.mark.parametrize(
    "argv", [["-n", "serving", "get", "x"], ["get", "x", "-n", "serving"], ["get", "-n", "serving", "x"]]
)
def test_connection_flags_go_before_or_after_the_command(argv: list[str]) -> None:
    from kvpolicy.plugin.cli import _parser

    assert _parser().parse_args(argv).namespace == "serving"
