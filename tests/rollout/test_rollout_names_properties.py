"""Property: for every legal KVPolicy name (a DNS-1123 subdomain of 1-253 characters, dots and digits included) every
object the builders make has a name and labels the API server accepts, checked with the emulated API server's own
validation (written from kube-apiserver's rules, not from the operator's naming code)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvpolicy.rollout import builders as b
from kvpolicy.rollout.gates import JOB_GATES
from kvpolicy.rollout.gates.job import JobInputs
from kvpolicy_dev.devcluster.validation import dns1035_label, dns1123_subdomain, label_value, validate
from operator_helpers import CONFIG, make_policy, target_deployment
from test_rollout_builders import FA3_PLAN, FP8_PLAN

INT64_MAX = 2**63 - 1
_label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
# DNS-1123 subdomains: dot-separated labels, 253 characters at most.
_subdomains = st.lists(_label, min_size=1, max_size=8).map(".".join).filter(lambda name: len(name) <= 253)
policy_names = _subdomains | st.sampled_from(["a", "7", "llama-3.1-8b", "x" * 253, "9" * 63 + "." + "z" * 189])
generations = st.integers(min_value=1, max_value=INT64_MAX)


def _children(policy: str, generation: int) -> list[tuple[str, dict[str, object]]]:
    ref = b.PolicyRef(policy, "serving", "uid-1")
    spec = make_policy().spec
    target = target_deployment()
    canary = b.canary_name(policy, generation)
    selector = target["spec"]["selector"]["matchLabels"]
    children: list[tuple[str, dict[str, object]]] = [
        ("Deployment", b.canary_deployment(ref, canary, target, spec, FP8_PLAN)),
        ("Service", b.canary_service(ref, canary, 8000)),
        ("Service", b.baseline_service(ref, selector, 8000, b.baseline_service_name(policy, generation))),
    ]
    for gate in JOB_GATES:
        name = b.job_name(policy, gate.name, generation)
        inputs = JobInputs(
            spec, CONFIG, name, target["spec"]["template"]["spec"], FA3_PLAN, "http://c:8000", "http://b:8000"
        )
        children.append(("Job", b.gate_job(ref, gate.build(inputs))))
    return children


@settings(max_examples=300, deadline=None)
@given(policy=policy_names, generation=generations)
def test_every_child_of_any_legal_policy_name_is_valid(policy: str, generation: int) -> None:
    assert dns1123_subdomain(policy) == [], "the strategy makes legal policy names"
    for kind, obj in _children(policy, generation):
        assert validate(kind, obj, creating=True) == [], (kind, obj["metadata"])
        name = obj["metadata"]["name"]  # type: ignore[index]
        assert dns1035_label(name) == [], name
    assert label_value(b.policy_labels(policy)[b.POLICY_LABEL]) == []


@settings(max_examples=300, deadline=None)
@given(first=policy_names, second=policy_names, generation=generations)
def test_two_policies_never_share_a_child(first: str, second: str, generation: int) -> None:
    if first == second:
        return
    for suffix in ("canary", "baseline", "accuracy"):
        assert b.job_name(first, suffix, generation) != b.job_name(second, suffix, generation)
    assert b.policy_labels(first) != b.policy_labels(second)
