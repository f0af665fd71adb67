"""The resource types the emulated API server serves: built-in ones and those CRDs declare at runtime."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpolicy_dev.devcluster.tables import AGE_COLUMN, PrinterColumn

CRD_GROUP = "apiextensions.k8s.io"
CRD_PLURAL = "customresourcedefinitions"
VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = False  # a status subresource: status is written via /status only
    printer_columns: tuple[PrinterColumn, ...] = (AGE_COLUMN,)
    # The preferred (storage) version of the group: the one discovery names first.
    preferred: bool = True
    extra_subresources: tuple[str, ...] = field(default=())
    # A CRD version's openAPIV3Schema: objects are defaulted and validated against it, as kube-apiserver does.
    schema: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def key(self) -> tuple[str, str]:
        """Objects are stored per group and plural, whichever served version they were written through."""
        return (self.group, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def discovery_entries(self) -> list[dict[str, Any]]:
        entry = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(VERBS),
            "shortNames": list(self.short_names),
            "categories": list(self.categories),
        }
        subresources = (("status",) if self.has_status else ()) + self.extra_subresources
        return [entry] + [
            {
                "name": f"{self.plural}/{sub}",
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": ["get", "patch", "update"],
            }
            for sub in subresources
        ]


def _columns(*specs: tuple[str, str, str]) -> tuple[PrinterColumn, ...]:
    return (*(PrinterColumn(name, type_, path) for name, type_, path in specs), AGE_COLUMN)


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",),
                 printer_columns=_columns(("Status", "string", ".status.phase"))),
    ResourceType("", "v1", "nodes", "Node", namespaced=False, short_names=("no",), has_status=True,
                 printer_columns=_columns(("GPU", "string", ".metadata.labels.nvidia\\.com/gpu\\.product"))),
    ResourceType("", "v1", "pods", "Pod", namespaced=True, short_names=("po",), has_status=True,
                 categories=("all",), extra_subresources=("log",),
                 printer_columns=_columns(("Status", "string", ".status.phase"), ("IP", "string", ".status.podIP"),
                                          ("Node", "string", ".spec.nodeName"))),
    ResourceType("", "v1", "services", "Service", namespaced=True, short_names=("svc",), has_status=True,
                 categories=("all",)),
    ResourceType("", "v1", "configmaps", "ConfigMap", namespaced=True, short_names=("cm",)),
    ResourceType("", "v1", "secrets", "Secret", namespaced=True),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", namespaced=True, short_names=("sa",)),
    ResourceType("", "v1", "events", "Event", namespaced=True, short_names=("ev",),
                 printer_columns=_columns(("Type", "string", ".type"), ("Reason", "string", ".reason"),
                                          ("Message", "string", ".message"))),
    ResourceType("apps", "v1", "deployments", "Deployment", namespaced=True, short_names=("deploy",),
                 has_status=True, categories=("all",), extra_subresources=("scale",),
                 printer_columns=_columns(("Replicas", "integer", ".spec.replicas"),
                                          ("Ready", "integer", ".status.readyReplicas"),
                                          ("Available", "integer", ".status.availableReplicas"))),
    ResourceType("apps", "v1", "replicasets", "ReplicaSet", namespaced=True, short_names=("rs",), has_status=True,
                 extra_subresources=("scale",),
                 printer_columns=_columns(("Desired", "integer", ".spec.replicas"),
                                          ("Ready", "integer", ".status.readyReplicas"))),
    ResourceType("batch", "v1", "jobs", "Job", namespaced=True, has_status=True, categories=("all",),
                 printer_columns=_columns(("Succeeded", "integer", ".status.succeeded"),
                                          ("Failed", "integer", ".status.failed"))),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True),
    ResourceType("events.k8s.io", "v1", "events", "Event", namespaced=True, short_names=("ev",)),
    ResourceType(CRD_GROUP, "v1", CRD_PLURAL, "CustomResourceDefinition", namespaced=False,
                 short_names=("crd", "crds"), has_status=True),
)  # fmt: skip


class CRDError(ValueError):
    """A CustomResourceDefinition the server cannot serve (answered with 422 Invalid)."""


def types_from_crd(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The resource types a CRD declares: one per served version."""
    try:
        spec = crd["spec"]
        group, names = spec["group"], spec["names"]
        plural, kind = names["plural"], names["kind"]
        versions = spec["versions"]
    except (KeyError, TypeError) as exc:
        raise CRDError(f"CustomResourceDefinition lacks spec field {exc}") from exc
    served = [version for version in versions if version.get("served", True)]
    storage = next((version["name"] for version in served if version.get("storage")), served[0]["name"])
    return [
        ResourceType(
            group=group,
            version=version["name"],
            plural=plural,
            kind=kind,
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular", kind.lower()),
            short_names=tuple(names.get("shortNames", ())),
            categories=tuple(names.get("categories", ())),
            has_status="status" in (version.get("subresources") or {}),
            printer_columns=tuple(
                PrinterColumn.from_crd(column) for column in version.get("additionalPrinterColumns", ())
            )
            or (AGE_COLUMN,),
            preferred=version["name"] == storage,
            schema=(version.get("schema") or {}).get("openAPIV3Schema"),
        )
        for version in served
    ]
