"""Protobuf request bodies: the Secret/ConfigMap/DeleteOptions messages client-go sends (helm's release storage)."""

import base64

import pytest
from kvpolicy_dev.devcluster.protobuf import MAGIC, ProtobufError, decode, fields


def varint(value: int) -> bytes:
    out = b""
    while True:
        byte, value = value & 0x7F, value >> 7
        out += bytes([byte | (0x80 if value else 0)])
        if not value:
            return out


def field(number: int, value: bytes | str | int) -> bytes:
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def entry(number: int, key: str, value: bytes | str) -> bytes:
    return field(number, field(1, key) + field(2, value))


def envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    return MAGIC + field(1, field(1, api_version) + field(2, kind)) + field(2, raw)


# As Go writes it: unset strings as empty fields, timestamps as messages.
META = (field(1, "sh.helm.release.v1.rel.v1") + field(2, "") + field(3, "") + field(6, "") + field(7, 0)
        + field(8, field(1, 0)) + entry(11, "owner", "helm") + entry(11, "status", "deployed")
        + field(13, field(1, "Deployment") + field(3, "d") + field(4, "uid-1") + field(5, "apps/v1") + field(6, 1))
        + field(14, "example.dev/cleanup"))  # fmt: skip


def test_secret() -> None:
    raw = field(1, META) + entry(2, "release", b"\x1f\x8b\x00") + field(3, "helm.sh/release.v1")
    secret = decode(envelope("v1", "Secret", raw + entry(4, "plain", "text") + field(5, 1)))
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "sh.helm.release.v1.rel.v1",
            "labels": {"owner": "helm", "status": "deployed"},
            "ownerReferences": [{"kind": "Deployment", "name": "d", "uid": "uid-1", "apiVersion": "apps/v1",
                                 "controller": True}],
            "finalizers": ["example.dev/cleanup"],
        },
        "data": {"release": base64.b64encode(b"\x1f\x8b\x00").decode()},
        "type": "helm.sh/release.v1",
        "stringData": {"plain": "text"},
        "immutable": True,
    }  # fmt: skip


def test_configmap_and_delete_options() -> None:
    configmap = decode(
        envelope("v1", "ConfigMap", field(1, field(1, "c")) + entry(2, "k", "v") + entry(3, "b", b"\x00"))
    )
    assert configmap["data"] == {"k": "v"} and configmap["binaryData"] == {"b": "AA=="}
    assert decode(envelope("meta.k8s.io/v1", "DeleteOptions", field(1, 30) + field(4, "Foreground"))) == {
        "kind": "DeleteOptions", "propagationPolicy": "Foreground"}  # fmt: skip


def test_unsupported_bodies_are_named() -> None:
    with pytest.raises(ProtobufError, match=r"not Deployment \(apps/v1\).*kubectl apply -f"):
        decode(envelope("apps/v1", "Deployment", b""))
    with pytest.raises(ProtobufError, match="Secret field 9"):
        decode(envelope("v1", "Secret", field(9, "x")))
    with pytest.raises(ProtobufError, match="ObjectMeta field 15"):
        decode(envelope("v1", "ConfigMap", field(1, field(15, "x"))))
    with pytest.raises(ProtobufError, match="prefix"):
        decode(b'{"kind": "Secret"}')
    with pytest.raises(ProtobufError, match="truncated"):
        list(fields(field(1, "abc")[:-1]))
