"""Object names and labels checked as kube-apiserver checks them (k8s.io/apimachinery/pkg/util/validation and the
per-kind name rules of pkg/apis/*/validation), with the same messages and a 422 `Invalid` Status naming each field.

Written from the Kubernetes sources, independently of the operator's own naming code, so that a test against the
emulated cluster catches a name the operator derives wrongly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
QUALIFIED_NAME_MAX = 63
# apimachinery's ValidateAnnotations: keys and values of one object's annotations together.
TOTAL_ANNOTATION_SIZE_LIMIT_BYTES = 256 * 1024
# names.SimpleNameGenerator: generateName is cut to 58 characters before 5 random ones are appended.
GENERATED_NAME_BASE_MAX = 58

_DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN_FMT = rf"{_DNS1123_LABEL_FMT}(\.{_DNS1123_LABEL_FMT})*"
_DNS1035_LABEL_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
_QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE_FMT = f"({_QUALIFIED_NAME_FMT})?"

DNS1123_LABEL_ERROR = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end "
    f"with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    f"'{_DNS1123_LABEL_FMT}')"
)
DNS1123_SUBDOMAIN_ERROR = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start "
    f"and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    f"'{_DNS1123_SUBDOMAIN_FMT}')"
)
DNS1035_LABEL_ERROR = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, "
    f"and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is "
    f"'{_DNS1035_LABEL_FMT}')"
)
LABEL_VALUE_ERROR = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    f"validation is '{_LABEL_VALUE_FMT}')"
)
QUALIFIED_NAME_ERROR = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    f"'{_QUALIFIED_NAME_FMT}')"
)


def _too_long(limit: int) -> str:
    return f"must be no more than {limit} characters"


def _check(pattern: str, error: str, limit: int) -> Callable[[str], list[str]]:
    compiled = re.compile(pattern)

    def check(value: str) -> list[str]:
        problems = [_too_long(limit)] if len(value) > limit else []
        if not compiled.fullmatch(value):
            problems.append(error)
        return problems

    return check


dns1123_label = _check(_DNS1123_LABEL_FMT, DNS1123_LABEL_ERROR, DNS1123_LABEL_MAX)
dns1123_subdomain = _check(_DNS1123_SUBDOMAIN_FMT, DNS1123_SUBDOMAIN_ERROR, DNS1123_SUBDOMAIN_MAX)
dns1035_label = _check(_DNS1035_LABEL_FMT, DNS1035_LABEL_ERROR, DNS1123_LABEL_MAX)
label_value = _check(_LABEL_VALUE_FMT, LABEL_VALUE_ERROR, LABEL_VALUE_MAX)
_qualified_name_part = _check(_QUALIFIED_NAME_FMT, QUALIFIED_NAME_ERROR, QUALIFIED_NAME_MAX)


def qualified_name(value: str) -> list[str]:
    """A label or annotation key: `[prefix/]name`, the prefix a DNS-1123 subdomain."""
    prefix, slash, name = value.rpartition("/")
    if slash and not prefix:
        return ["prefix part must be non-empty"]
    problems = [f"prefix part {problem}" for problem in dns1123_subdomain(prefix)] if slash else []
    if not name:
        return [*problems, "name part must be non-empty"]
    return problems + _qualified_name_part(name)


# Which rule a kind's metadata.name follows (everything else: a DNS-1123 subdomain).
NAME_RULES: dict[str, Callable[[str], list[str]]] = {
    "Namespace": dns1123_label,
    "Service": dns1035_label,
}


def generated_name_base(generate_name: str) -> str:
    return generate_name[:GENERATED_NAME_BASE_MAX]


class FieldError:
    """One `field.Error`, worded like kube-apiserver: `<field>: Invalid value: "<value>": <detail>`, or
    `<field>: Required value`, or `<field>: Unsupported value: "<value>": <detail>`."""

    HEADINGS: ClassVar[dict[str, str]] = {
        "FieldValueInvalid": "Invalid value",
        "FieldValueNotSupported": "Unsupported value",
    }

    def __init__(self, field: str, value: str, detail: str, reason: str = "FieldValueInvalid") -> None:
        self.field, self.value, self.detail, self.reason = field, value, detail, reason

    def _described(self) -> str:
        if self.reason == "FieldValueRequired":
            return "Required value"
        if self.reason == "FieldValueTooLong":
            return f"Too long: must have at most {TOTAL_ANNOTATION_SIZE_LIMIT_BYTES} bytes"
        return f'{self.HEADINGS[self.reason]}: "{self.value}": {self.detail}'

    def __str__(self) -> str:
        return f"{self.field}: {self._described()}"

    def cause(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self._described(), "field": self.field}


def _labels(labels: Any, path: str) -> list[FieldError]:
    if not isinstance(labels, Mapping):
        return []
    errors = [FieldError(path, str(key), detail) for key in labels for detail in qualified_name(str(key))]
    for value in labels.values():
        errors += [FieldError(path, str(value), detail) for detail in label_value(str(value))]
    return errors


def _template_labels(obj: Mapping[str, Any]) -> Any:
    return (((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels")


def validate(kind: str, obj: Mapping[str, Any], creating: bool) -> list[FieldError]:
    """The field errors kube-apiserver reports for this object's name (on create) and its labels."""
    meta = obj.get("metadata") or {}
    errors: list[FieldError] = []
    if creating:
        name = str(meta.get("name") or "")
        name_rule = NAME_RULES.get(kind, dns1123_subdomain)
        errors += [FieldError("metadata.name", name, detail) for detail in name_rule(name)]
    errors += _labels(meta.get("labels"), "metadata.labels")
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errors += [FieldError("metadata.annotations", str(key), detail) for detail in qualified_name(str(key).lower())]
    size = sum(len(str(key).encode()) + len(str(value).encode()) for key, value in annotations.items())
    if size > TOTAL_ANNOTATION_SIZE_LIMIT_BYTES:
        errors.append(FieldError("metadata.annotations", "", "", reason="FieldValueTooLong"))
    spec = obj.get("spec") or {}
    if kind in ("Deployment", "ReplicaSet", "Job"):
        errors += _labels(_template_labels(obj), "spec.template.labels")
        errors += _labels((spec.get("selector") or {}).get("matchLabels"), "spec.selector.matchLabels")
    if kind == "Job" and creating and not spec.get("manualSelector"):
        # The API server labels the Job's pod template with its name (batch.kubernetes.io/job-name, job-name).
        name = str(meta.get("name") or "")
        errors += [FieldError("spec.template.labels", name, detail) for detail in label_value(name)]
    if kind == "Service":
        errors += _labels(spec.get("selector"), "spec.selector")
    return errors
