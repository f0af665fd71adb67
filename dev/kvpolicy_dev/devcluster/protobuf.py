"""Decode the few protobuf request bodies Kubernetes clients insist on sending (helm's release Secrets).

client-go's typed clients (helm's release storage, `kubectl create GENERATOR`) encode built-in objects as protobuf,
whatever the server prefers; responses may still be JSON. Only Secret, ConfigMap and DeleteOptions are decoded here:
the messages helm sends. Anything else is refused with a message naming it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

MAGIC = b"k8s\x00"
WireValue = int | bytes


class ProtobufError(ValueError):
    """A protobuf body this server does not decode."""


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, WireValue]]:
    """(field number, value) pairs of one message: ints for varints and fixed-width fields, bytes otherwise."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _varint(data, position)
            yield number, value
        elif wire_type == 2:
            length, position = _varint(data, position)
            if position + length > len(data):
                raise ProtobufError("truncated length-delimited field")
            yield number, data[position : position + length]
            position += length
        elif wire_type in (1, 5):
            width = 8 if wire_type == 1 else 4
            yield number, int.from_bytes(data[position : position + width], "little")
            position += width
        else:
            raise ProtobufError(f"unsupported wire type {wire_type}")


def _text(value: WireValue) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a string field")
    return value.decode()


def _bytes(value: WireValue) -> bytes:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a bytes field")
    return value


def _map_entry(value: WireValue) -> tuple[str, bytes]:
    entry = dict(fields(_bytes(value)))
    return _text(entry.get(1, b"")), _bytes(entry.get(2, b""))


def _owner_reference(value: WireValue) -> dict[str, Any]:
    names = {1: "kind", 3: "name", 4: "uid", 5: "apiVersion"}
    flags = {6: "controller", 7: "blockOwnerDeletion"}
    reference: dict[str, Any] = {}
    for number, field in fields(_bytes(value)):
        if number in names:
            reference[names[number]] = _text(field)
        elif number in flags:
            reference[flags[number]] = bool(field)
    return reference


# ObjectMeta fields the server sets itself (selfLink, timestamps, grace period, managedFields) are dropped.
_SERVER_SET_META = {4, 8, 9, 10, 17}


def _object_meta(data: bytes) -> dict[str, Any]:
    strings = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    meta: dict[str, Any] = {}
    for number, value in fields(data):
        if value in (b"", 0):
            continue  # Go's encoder writes unset strings and numbers as empty values
        if number in strings:
            meta[strings[number]] = _text(value)
        elif number == 7:
            meta["generation"] = value
        elif number in (11, 12):
            key, item = _map_entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = item.decode()
        elif number == 13:
            meta.setdefault("ownerReferences", []).append(_owner_reference(value))
        elif number == 14:
            meta.setdefault("finalizers", []).append(_text(value))
        elif number not in _SERVER_SET_META:
            raise ProtobufError(f"ObjectMeta field {number} is not supported in protobuf bodies")
    return meta


def _secret(data: bytes) -> dict[str, Any]:
    secret: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret"}
    for number, value in fields(data):
        if number == 1:
            secret["metadata"] = _object_meta(_bytes(value))
        elif number in (2, 4):
            key, item = _map_entry(value)
            if number == 2:
                secret.setdefault("data", {})[key] = base64.b64encode(item).decode()
            else:
                secret.setdefault("stringData", {})[key] = item.decode()
        elif number == 3:
            secret["type"] = _text(value)
        elif number == 5:
            secret["immutable"] = bool(value)
        else:
            raise ProtobufError(f"Secret field {number} is not supported in protobuf bodies")
    return secret


def _configmap(data: bytes) -> dict[str, Any]:
    configmap: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap"}
    for number, value in fields(data):
        if number == 1:
            configmap["metadata"] = _object_meta(_bytes(value))
        elif number in (2, 3):
            key, item = _map_entry(value)
            if number == 2:
                configmap.setdefault("data", {})[key] = item.decode()
            else:
                configmap.setdefault("binaryData", {})[key] = base64.b64encode(item).decode()
        elif number == 4:
            configmap["immutable"] = bool(value)
        else:
            raise ProtobufError(f"ConfigMap field {number} is not supported in protobuf bodies")
    return configmap


def _delete_options(data: bytes) -> dict[str, Any]:
    # Only the propagation policy matters here; grace periods and preconditions are not emulated.
    policy = next((_text(value) for number, value in fields(data) if number == 4), None)
    return {"kind": "DeleteOptions", "propagationPolicy": policy} if policy else {"kind": "DeleteOptions"}


_DECODERS: dict[tuple[str, str], Callable[[bytes], dict[str, Any]]] = {
    ("v1", "Secret"): _secret,
    ("v1", "ConfigMap"): _configmap,
    ("v1", "DeleteOptions"): _delete_options,
    ("meta.k8s.io/v1", "DeleteOptions"): _delete_options,
}


def decode(body: bytes) -> dict[str, Any]:
    """A Kubernetes protobuf envelope (`k8s\\0` + runtime.Unknown) as the JSON object it encodes."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf body (no k8s\\0 prefix)")
    envelope = dict(fields(body[len(MAGIC) :]))
    type_meta = dict(fields(_bytes(envelope.get(1, b""))))
    api_version, kind = _text(type_meta.get(1, b"")), _text(type_meta.get(2, b""))
    decoder = _DECODERS.get((api_version, kind))
    if decoder is None:
        raise ProtobufError(
            f"the dev cluster decodes protobuf bodies of Secret, ConfigMap and DeleteOptions only, not {kind} "
            f"({api_version}); send JSON (e.g. `kubectl apply -f` instead of `kubectl create {kind.lower()}`)"
        )
    return decoder(_bytes(envelope.get(2, b"")))
