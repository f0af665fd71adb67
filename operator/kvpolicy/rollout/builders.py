"""Pure builders of the objects the operator creates or patches: names, canary, Services, gate Jobs, container patches.

Every name is deterministic (policy + generation), so creating an object twice is harmless: AlreadyExists means done.
Names and label values derived from the policy's name follow the one rule in child_names.py.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpolicy.api.v1alpha1 import (
    API_VERSION,
    KIND,
    ContainerRecord,
    KVPolicySpec,
    Parallelism,
    Plan,
    PodTemplateRecord,
)
from kvpolicy.gate_programs.report import DEFAULT_TERMINATION_LOG
from kvpolicy.rollout.child_names import child_name, label_value

Obj = dict[str, Any]

POLICY_LABEL = "kvpolicy.dev/policy"
ROLE_LABEL = "kvpolicy.dev/role"
CANARY_LABEL = "kvpolicy.dev/canary"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvpolicy"
ROLE_CANARY = "canary"
ROLE_BASELINE = "baseline"
ROLE_GATE = "gate"

DEFAULT_SERVING_PORT = 8000
# vLLM flags the plan owns: stripped from the target's arguments before the plan's are appended.
KV_FLAGS = ("--kv-cache-dtype", "--kv-cache-dtype-skip-layers", "--attention-backend")
# Flags whose value is a list of tokens (until the next flag) rather than one token.
MULTI_VALUE_FLAGS = frozenset({"--kv-cache-dtype-skip-layers"})
GATE_TERMINATION_LOG = str(DEFAULT_TERMINATION_LOG)


def rollout_suffix(generation: int, run: int = 1) -> str:
    """`g<generation>`, and `r<run>` for a rollout run again at the same generation (drift, a changed target, a
    retry), so its children never share a name with an earlier run's that may still be terminating."""
    return f"g{generation}" if run <= 1 else f"g{generation}r{run}"


def canary_name(policy: str, generation: int, run: int = 1) -> str:
    return child_name(policy, f"canary-{rollout_suffix(generation, run)}")


def baseline_service_name(policy: str, generation: int, run: int = 1) -> str:
    """The gates' view of the target's pods, one per rollout (its canary's generation and run)."""
    return child_name(policy, f"baseline-{rollout_suffix(generation, run)}")


def job_name(policy: str, gate: str, generation: int, run: int = 1) -> str:
    """gate: accuracy, latency or preflight."""
    return child_name(policy, f"{gate}-{rollout_suffix(generation, run)}")


def policy_labels(policy: str) -> dict[str, str]:
    """The label every child of the policy carries: what observe and cleanup select them by."""
    return {POLICY_LABEL: label_value(policy)}


@dataclass(frozen=True)
class PolicyRef:
    """The identity of a KVPolicy that its children point back to."""

    name: str
    namespace: str
    uid: str

    def owner_reference(self) -> Obj:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def labels(self, role: str) -> dict[str, str]:
        return {**policy_labels(self.name), ROLE_LABEL: role, MANAGED_BY_LABEL: MANAGED_BY}

    def metadata(self, name: str, role: str, extra_labels: Mapping[str, str] | None = None) -> Obj:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": {**self.labels(role), **(extra_labels or {})},
            "ownerReferences": [self.owner_reference()],
        }


# ------------------------------------------------------------------------------------------------ the vLLM container


class TargetShapeError(ValueError):
    """The target cannot be rolled out (no such container, no pod template)."""


def container_index(deployment: Mapping[str, Any], container: str | None) -> int:
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
    return index_in(containers, container, f"Deployment {deployment['metadata']['name']}")


def index_in(containers: Sequence[Mapping[str, Any]], container: str | None, owner: str) -> int:
    """The index of the vLLM container among a pod template's `containers` (the first when unnamed); `owner` names
    the object in the error (`Deployment llama`)."""
    if not containers:
        raise TargetShapeError(f"{owner} has no containers in its pod template")
    if container is None:
        return 0
    for index, item in enumerate(containers):
        if item.get("name") == container:
            return index
    names = ", ".join(str(item.get("name")) for item in containers)
    raise TargetShapeError(f"{owner} has no container {container!r} (it has: {names}); fix spec.targetRef.container")


R = TypeVar("R", bound=ContainerRecord)


def container_record(container: Mapping[str, Any]) -> PodTemplateRecord:
    """What a rollback must restore: image, command, args, env, exactly as they were."""
    return PodTemplateRecord(
        image=container.get("image", ""),
        command=copy.deepcopy(container.get("command")),
        args=copy.deepcopy(container.get("args")),
        env=copy.deepcopy(container.get("env")),
    )


def split_kv_flags(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """A command line split into (everything else, the plan-owned flags with their values), both in order; both
    `--flag value` and `--flag=value` forms."""
    rest: list[str] = []
    owned: list[str] = []
    skipping_values = False
    skip_one = False
    for token in tokens:
        if skip_one:
            skip_one = False
            owned.append(token)
            continue
        if skipping_values:
            if not token.startswith("-"):
                owned.append(token)
                continue
            skipping_values = False
        flag = token.split("=", 1)[0]
        if flag in KV_FLAGS:
            owned.append(token)
            if "=" not in token:
                if flag in MULTI_VALUE_FLAGS:
                    skipping_values = True
                else:
                    skip_one = True
            continue
        rest.append(token)
    return rest, owned


def strip_kv_flags(tokens: Sequence[str]) -> list[str]:
    """Remove the plan-owned flags from a command line."""
    return split_kv_flags(tokens)[0]


def kv_cache_dtype(tokens: Sequence[str]) -> str:
    """The --kv-cache-dtype a command line selects ("auto" when absent)."""
    value = "auto"
    for index, token in enumerate(tokens):
        if token.startswith("--kv-cache-dtype="):
            value = token.split("=", 1)[1]
        elif token == "--kv-cache-dtype" and index + 1 < len(tokens):
            value = tokens[index + 1]
    return value


# vLLM's parallel-size flags and their short forms (vLLM's parser takes `_` for `-` in long flags too).
PARALLEL_FLAGS = {
    "--tensor-parallel-size": "tensor",
    "-tp": "tensor",
    "--pipeline-parallel-size": "pipeline",
    "-pp": "pipeline",
    "--data-parallel-size": "data",
    "-dp": "data",
}


# KServe's vLLM template runs `vllm serve ... ${VLLM_ADDITIONAL_ARGS} $@`: serving flags may sit in this env var too.
ADDITIONAL_ARGS_ENV = "VLLM_ADDITIONAL_ARGS"


def _additional_args(env: Sequence[Mapping[str, Any]] | None) -> list[str]:
    for item in env or []:
        if item.get("name") == ADDITIONAL_ARGS_ENV and isinstance(item.get("value"), str):
            return str(item["value"]).split()
    return []


def serving_tokens(record: ContainerRecord) -> list[str]:
    """The vLLM flags a container gives, in the order vLLM reads them: command, VLLM_ADDITIONAL_ARGS, args."""
    return [*(record.command or []), *_additional_args(record.env), *(record.args or [])]


def _env_without_kv_flags(env: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The env with the plan-owned flags taken out of VLLM_ADDITIONAL_ARGS (the variable kept, even empty)."""
    if env is None:
        return None
    return [
        {**item, "value": " ".join(strip_kv_flags(_additional_args([item])))}
        if item.get("name") == ADDITIONAL_ARGS_ENV and split_kv_flags(_additional_args([item]))[1]
        else item
        for item in env
    ]


def parallelism(record: ContainerRecord) -> Parallelism:
    """The parallel sizes a command line asks vLLM for (the last of a repeated flag wins, as in argparse)."""
    tokens = serving_tokens(record)
    sizes: dict[str, int] = {}
    for index, token in enumerate(tokens):
        flag, sep, value = token.partition("=")
        name = PARALLEL_FLAGS.get(flag.replace("_", "-") if flag.startswith("--") else flag)
        if name is None:
            continue
        text = value if sep else (tokens[index + 1] if index + 1 < len(tokens) else "")
        if text.isdigit():
            sizes[name] = int(text)
    return Parallelism.model_validate(sizes)


def runs_fp8(record: PodTemplateRecord) -> bool:
    return kv_cache_dtype(serving_tokens(record)).startswith("fp8")


def with_plan(record: R, plan: Plan) -> R:
    """The container configuration the plan asks for: plan image (or the same), KV flags replaced by the plan's."""
    return with_kv_flags(record, plan.extra_args, plan.image or record.image)


def with_kv_flags(record: R, flags: Sequence[str], image: str) -> R:
    """`record` running `image`, its plan-owned flags replaced by `flags` (in args, or in the command without any);
    its companions as they are."""
    command = strip_kv_flags(record.command) if record.command is not None else None
    args = strip_kv_flags(record.args) if record.args is not None else None
    if args is not None or command is None:
        args = [*(args or []), *flags]
    else:
        command = [*command, *flags]
    return record.model_copy(
        update={"image": image, "command": command, "args": args, "env": _env_without_kv_flags(record.env)}
    )


def without_fp8(record: PodTemplateRecord) -> PodTemplateRecord:
    """The BF16 configuration of a target that was set to FP8 outside a recorded promotion (companions too)."""

    def bf16(item: R) -> R:
        return item.model_copy(
            update={
                "command": strip_kv_flags(item.command) if item.command is not None else None,
                "args": strip_kv_flags(item.args) if item.args is not None else None,
                "env": _env_without_kv_flags(item.env),
            }
        )

    companions = {role: bf16(item) for role, item in (record.companions or {}).items()}
    return bf16(record).model_copy(update={"companions": companions or None})


def follow_image(companion: R, main_before: str, main_after: str) -> R:
    """A companion container's image once the main container goes from `main_before` to `main_after`: the new one
    where it ran the main container's image, its own otherwise."""
    return companion.model_copy(update={"image": main_after if companion.image == main_before else companion.image})


SERVING_FIELDS = ("image", "command", "args", "env")


def container_patch(deployment: Mapping[str, Any], container: str | None, desired: PodTemplateRecord) -> list[Obj]:
    """A JSON patch setting one container's image, command, args and env exactly to `desired`."""
    index = container_index(deployment, container)
    current = deployment["spec"]["template"]["spec"]["containers"][index]
    return container_ops(f"/spec/template/spec/containers/{index}", current, desired)


def container_ops(path: str, current: Mapping[str, Any], desired: ContainerRecord) -> list[Obj]:
    """JSON patch operations setting the container at `path` (now `current`) to `desired`.

    They first test the container's name and the values they replace, so a patch computed against an old template
    cannot hit another container or overwrite an edit it has not seen.
    """
    ops: list[Obj] = [{"op": "test", "path": f"{path}/name", "value": current.get("name")}]
    # The fields it replaces must still be what was observed: an edit made since fails the patch (422), and the next
    # pass observes it (and restarts the analysis rather than overwrite a configuration nobody gated).
    ops += [
        {"op": "test", "path": f"{path}/{name}", "value": current[name]} for name in SERVING_FIELDS if name in current
    ]
    for attribute, value in (("image", desired.image), ("command", desired.command), ("args", desired.args)):
        if attribute == "image" and not value and "image" not in current:
            continue  # no image of its own (a KServe template's container takes its preset's)
        if value is not None:
            ops.append({"op": "add", "path": f"{path}/{attribute}", "value": value})
        elif attribute in current:
            ops.append({"op": "remove", "path": f"{path}/{attribute}"})
    if desired.env is not None:
        ops.append({"op": "add", "path": f"{path}/env", "value": desired.env})
    elif "env" in current:
        ops.append({"op": "remove", "path": f"{path}/env"})
    return ops


def set_container(container: Obj, record: ContainerRecord) -> None:
    """Give a container (in place) the record's image, command, args and env; a None field is removed (an empty
    image too: a KServe template's container may take its preset's)."""
    if record.image or "image" in container:
        container["image"] = record.image
    for attribute, value in (("command", record.command), ("args", record.args), ("env", record.env)):
        if value is None:
            container.pop(attribute, None)
        else:
            container[attribute] = copy.deepcopy(value)


def container_entry(current: Mapping[str, Any], desired: ContainerRecord) -> Obj:
    """The container `current` as a strategic/merge patch entry setting it to `desired` (null removes a field)."""
    entry: Obj = {"name": current.get("name"), "image": desired.image}
    for attribute, value in (("command", desired.command), ("args", desired.args), ("env", desired.env)):
        if value is not None:
            entry[attribute] = value
        elif attribute in current:
            entry[attribute] = None
    return entry


def serving_port(container: Mapping[str, Any]) -> int:
    """The port vLLM listens on: the container port named http, else the first, else --port, else 8000."""
    ports = container.get("ports") or []
    for port in ports:
        if port.get("name") == "http":
            return int(port["containerPort"])
    if ports:
        return int(ports[0]["containerPort"])
    tokens = [*(container.get("command") or []), *(container.get("args") or [])]
    for index, token in enumerate(tokens):
        if token.startswith("--port="):
            return int(token.split("=", 1)[1])
        if token == "--port" and index + 1 < len(tokens):
            return int(tokens[index + 1])
    return DEFAULT_SERVING_PORT


def service_url(service: str, namespace: str, port: int) -> str:
    return f"http://{service}.{namespace}.svc:{port}"


# ------------------------------------------------------------------------------------------------ canary and Services


def template_labels(deployment: Mapping[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"].get("metadata", {}).get("labels") or {}
    return dict(labels)


def canary_pod_labels(policy: PolicyRef, name: str, target_labels: Mapping[str, str], joined: bool) -> dict[str, str]:
    """Before the accuracy gate the canary's pods carry none of the target's labels (`target_labels`), so no Service
    that selects the target's pods (the users' Service included) can send them traffic; joining adds them back."""
    own = {**policy.labels(ROLE_CANARY), CANARY_LABEL: name}
    return {**target_labels, **own} if joined else own


def canary_deployment(
    policy: PolicyRef, name: str, target: Mapping[str, Any], spec: KVPolicySpec, plan: Plan, joined: bool = False
) -> Obj:
    """A Deployment cloned from the target's pod template, running the plan's image and vLLM flags."""
    template = copy.deepcopy(target["spec"]["template"])
    index = container_index(target, spec.target_ref.container)
    container = template["spec"]["containers"][index]
    set_container(container, with_plan(container_record(container), plan))
    metadata = template.setdefault("metadata", {})
    metadata["labels"] = canary_pod_labels(policy, name, template_labels(target), joined)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": policy.metadata(name, ROLE_CANARY, {CANARY_LABEL: name}),
        "spec": {
            "replicas": spec.rollout.canary_replicas,
            "selector": {"matchLabels": {**policy_labels(policy.name), CANARY_LABEL: name}},
            # Recreate: a change of the canary's template must not need a second GPU for a surge pod (joining the
            # traffic changes none: it labels the running pods).
            "strategy": {"type": "Recreate"},
            "template": template,
        },
    }


def _service(policy: PolicyRef, name: str, role: str, selector: Mapping[str, str], port: int) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": policy.metadata(name, role),
        "spec": {
            "selector": dict(selector),
            "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def canary_service(policy: PolicyRef, name: str, port: int, serving: Mapping[str, str] | None = None) -> Obj:
    """The canary's serving pods (`serving`: labels only they carry among the canary's pods, where its workers carry
    the canary label too)."""
    selector = {**policy_labels(policy.name), CANARY_LABEL: name, **(serving or {})}
    return _service(policy, name, ROLE_CANARY, selector, port)


def baseline_service(policy: PolicyRef, selector: Mapping[str, str], port: int, name: str) -> Obj:
    """The gates' view of the target's serving pods (`selector`: for a Deployment what it selects, which the canary's
    pods only match once they have joined: ReplicaRatio, after the accuracy gate)."""
    return _service(policy, name, ROLE_BASELINE, selector, port)


# ------------------------------------------------------------------------------------------------------- gate Jobs


@dataclass(frozen=True)
class GateJob:
    """What differs between gate Jobs: name, role, image, command, resources, and where the pod may run."""

    name: str
    role: str
    image: str
    command: list[str]
    timeout_seconds: int
    resources: Obj
    pod_placement: Obj  # nodeSelector / tolerations / affinity copied from the target for GPU Jobs
    image_pull_secrets: list[Obj] = field(default_factory=list)  # the target's: the images may share its registry
    env: list[Obj] = field(default_factory=list)


# The Pod Security Standards' "restricted" profile. The gate tools run as the operator image's user (Dockerfile: USER
# 10001); naming the user lets a root-by-default image (a vLLM image for the probe) run too.
GATE_USER = 10001
POD_SECURITY_CONTEXT: Obj = {
    "runAsNonRoot": True,
    "runAsUser": GATE_USER,
    "runAsGroup": GATE_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: Obj = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# The one writable place on a read-only root filesystem (temporary files; the probe's Triton and CUDA caches).
SCRATCH_DIR = "/tmp"
SCRATCH_VOLUME: Obj = {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}


def gate_job(policy: PolicyRef, job: GateJob) -> Obj:
    labels = policy.labels(job.role)
    container = {
        "name": job.role if job.role != ROLE_GATE else "gate",
        "image": job.image,
        "command": job.command,
        "resources": copy.deepcopy(job.resources),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": SCRATCH_VOLUME["name"], "mountPath": SCRATCH_DIR}],
        "terminationMessagePath": GATE_TERMINATION_LOG,
        # The tools write their JSON verdict to the termination log; logs are the fallback if they crash first.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if job.env:
        container["env"] = copy.deepcopy(job.env)
    pod_spec: Obj = {
        "restartPolicy": "Never",
        # The gate tools talk to the canary and baseline over HTTP; they need no Kubernetes credentials.
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [copy.deepcopy(SCRATCH_VOLUME)],
        **copy.deepcopy(job.pod_placement),
    }
    if job.image_pull_secrets:
        pod_spec["imagePullSecrets"] = copy.deepcopy(job.image_pull_secrets)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": policy.metadata(job.name, job.role),
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": job.timeout_seconds,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


GPU_RESOURCE = "nvidia.com/gpu"


def with_one_gpu(resources: Obj) -> Obj:
    """`resources` plus the one GPU the preflight probe measures, whatever the operator's settings say."""
    result = copy.deepcopy(resources)
    for part in ("requests", "limits"):
        result.setdefault(part, {})[GPU_RESOURCE] = 1
    return result


def image_pull_secrets(pod_spec: Mapping[str, Any]) -> list[Obj]:
    secrets: list[Obj] = pod_spec.get("imagePullSecrets") or []
    return copy.deepcopy(secrets)


# The gate tools read the servers' API key from this variable, which the gate Job sets from spec.vllmAuth's Secret:
# the Job's spec names the Secret and the variable, never the key itself.
API_KEY_ENV = "KVPOLICY_VLLM_API_KEY"


def api_key_env(spec: KVPolicySpec) -> list[Obj]:
    """The gate container's env entry for the servers' API key (none without spec.vllmAuth)."""
    if spec.vllm_auth is None:
        return []
    ref = spec.vllm_auth.api_key_secret_ref
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def api_key_args(spec: KVPolicySpec) -> list[str]:
    return ["--api-key-env", API_KEY_ENV] if spec.vllm_auth is not None else []


def pod_placement(pod_spec: Mapping[str, Any]) -> Obj:
    """The target's serving pods' scheduling constraints, so a GPU Job lands on the same pool."""
    return {key: copy.deepcopy(pod_spec[key]) for key in ("nodeSelector", "tolerations", "affinity") if key in pod_spec}
