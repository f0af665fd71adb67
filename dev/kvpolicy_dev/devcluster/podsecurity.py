"""The Pod Security Standards' Baseline and Restricted checks (the "Pod Security Standards" page of the Kubernetes
documentation, as of Kubernetes 1.32), applied to a pod spec: what Pod Security admission enforces in a namespace
labelled `pod-security.kubernetes.io/enforce: restricted` (or `baseline`).

Written from the standard's tables, control by control, independently of the operator's builders; each violation
reads as the admission controller words it (`allowPrivilegeEscalation != false (container "gate" must set ...)`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
LEVELS = ("privileged", "baseline", "restricted")

BASELINE_CAPABILITIES = frozenset(
    {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
     "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
)  # fmt: skip
SAFE_SYSCTLS = frozenset(
    {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
     "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
     "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
     "net.ipv4.tcp_keepalive_probes"}
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
Obj = Mapping[str, Any]


def _containers(spec: Obj) -> Iterator[Obj]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _context(obj: Obj) -> Obj:
    return obj.get("securityContext") or {}


def _named(containers: list[str]) -> str:
    names = ", ".join(f'"{name}"' for name in containers)
    return f"container {names}" if len(containers) == 1 else f"containers {names}"


def baseline(spec: Obj, annotations: Obj | None = None) -> list[str]:
    problems: list[str] = []
    pod = _context(spec)
    containers = list(_containers(spec))
    if (pod.get("windowsOptions") or {}).get("hostProcess") or any(
        (_context(c).get("windowsOptions") or {}).get("hostProcess") for c in containers
    ):
        problems.append("hostProcess (pod or containers must not set securityContext.windowsOptions.hostProcess=true)")
    host = [key for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    if host:
        problems.append(f"host namespaces ({', '.join(f'{key}=true' for key in host)})")
    privileged = [c["name"] for c in containers if _context(c).get("privileged")]
    if privileged:
        problems.append(f"privileged ({_named(privileged)} must not set securityContext.privileged=true)")
    for c in containers:
        added = set((_context(c).get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            problems.append(f'non-default capabilities (container "{c["name"]}" must not include '
                            f"{', '.join(sorted(added))} in securityContext.capabilities.add)")  # fmt: skip
    host_paths = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    if host_paths:
        problems.append(f"hostPath volumes (volumes {', '.join(host_paths)})")
    host_ports = [c["name"] for c in containers for p in c.get("ports") or [] if p.get("hostPort")]
    if host_ports:
        problems.append(f"hostPort ({_named(host_ports)} uses hostPort)")
    for owner in [spec, *containers]:
        profile = (_context(owner).get("appArmorProfile") or {}).get("type")
        if profile not in (None, "RuntimeDefault", "Localhost"):
            problems.append(f"forbidden AppArmor profile ({profile})")
        selinux = _context(owner).get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            problems.append("seLinuxOptions (forbidden securityContext.seLinuxOptions)")
        if (_context(owner).get("seccompProfile") or {}).get("type") == "Unconfined":
            problems.append("seccompProfile (securityContext.seccompProfile.type must not be Unconfined)")
    for key, value in (annotations or {}).items():
        if (
            key.startswith("container.apparmor.security.beta.kubernetes.io/")
            and value not in ("runtime/default",)
            and not str(value).startswith("localhost/")
        ):
            problems.append(f"forbidden AppArmor profile ({key}={value})")
    proc = [c["name"] for c in containers if _context(c).get("procMount") not in (None, "Default")]
    if proc:
        problems.append(f"procMount ({_named(proc)} must not set securityContext.procMount)")
    unsafe = [s["name"] for s in pod.get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    if unsafe:
        problems.append(f"forbidden sysctls ({', '.join(unsafe)})")
    return problems


def restricted(spec: Obj, annotations: Obj | None = None) -> list[str]:
    problems = baseline(spec, annotations)
    pod = _context(spec)
    containers = list(_containers(spec))
    volumes = [v["name"] for v in spec.get("volumes") or [] if not RESTRICTED_VOLUMES & set(v)]
    if volumes:
        problems.append(f"restricted volume types (volumes {', '.join(volumes)} must use an allowed volume type)")
    escalating = [c["name"] for c in containers if _context(c).get("allowPrivilegeEscalation") is not False]
    if escalating:
        problems.append(f"allowPrivilegeEscalation != false ({_named(escalating)} must set "
                        "securityContext.allowPrivilegeEscalation=false)")  # fmt: skip
    pod_non_root = pod.get("runAsNonRoot") is True
    root_allowed = [
        c["name"]
        for c in containers
        if _context(c).get("runAsNonRoot") is False or not (pod_non_root or _context(c).get("runAsNonRoot") is True)
    ]
    if root_allowed:
        problems.append(f"runAsNonRoot != true (pod or {_named(root_allowed)} must set "
                        "securityContext.runAsNonRoot=true)")  # fmt: skip
    if pod.get("runAsUser") == 0 or any(_context(c).get("runAsUser") == 0 for c in containers):
        problems.append("runAsUser=0 (pod and containers must not set runAsUser=0)")
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    unconfined = [
        c["name"]
        for c in containers
        if (_context(c).get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost")
    ]
    if unconfined:
        problems.append(f"seccompProfile (pod or {_named(unconfined)} must set securityContext.seccompProfile.type "
                        'to "RuntimeDefault" or "Localhost")')  # fmt: skip
    not_dropped = [c["name"] for c in containers
                   if "ALL" not in ((_context(c).get("capabilities") or {}).get("drop") or [])]  # fmt: skip
    if not_dropped:
        must = 'must set securityContext.capabilities.drop=["ALL"]'
        problems.append(f"unrestricted capabilities ({_named(not_dropped)} {must})")
    for c in containers:
        added = set((_context(c).get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            problems.append(f'unrestricted capabilities (container "{c["name"]}" must not include '
                            f"{', '.join(sorted(added))} in securityContext.capabilities.add)")  # fmt: skip
    return problems


def violations(level: str, pod_spec: Obj, annotations: Obj | None = None) -> list[str]:
    """What Pod Security admission at `level` refuses in this pod spec (empty: admitted)."""
    if level == "restricted":
        return restricted(pod_spec, annotations)
    if level == "baseline":
        return baseline(pod_spec, annotations)
    return []


def pod_template_specs(obj: Obj) -> Iterator[tuple[Obj, Obj]]:
    """The pod specs (and annotations) a workload object runs: a Pod's own, a Deployment's or Job's template."""
    if obj.get("kind") == "Pod":
        yield obj.get("spec") or {}, (obj.get("metadata") or {}).get("annotations") or {}
        return
    template = (obj.get("spec") or {}).get("template") or {}
    yield template.get("spec") or {}, (template.get("metadata") or {}).get("annotations") or {}
