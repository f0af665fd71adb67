"""The one rule for the names and label values of what a KVPolicy creates, valid for any legal policy name.

A KVPolicy's name is a DNS-1123 subdomain: up to 253 characters, dots and leading digits allowed. Its children's names
must be DNS-1035 labels (Services: at most 63 characters, a letter first, no dots), and a label value holds at most
63 characters. As Kubernetes' own controllers do, a name that does not fit as it is gets shortened, and a hash of the
whole policy name keeps two policies' children apart (`llama-3.1-8b` and `llama-3-1-8b` must not share a canary).
"""

from __future__ import annotations

import hashlib
import re

MAX_LABEL = 63  # DNS-1035/1123 labels and label values
HASH_LENGTH = 8
# A name kept as it is; anything else is hashed (the only mapping that cannot make two policies collide).
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# Letter-first prefix for a policy name that starts with a digit.
DIGIT_PREFIX = "kvp"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LENGTH]


def child_name(policy: str, suffix: str) -> str:
    """`<policy>-<suffix>` when that is a DNS-1035 label; otherwise `<readable part>-<hash>-<suffix>`, where the
    readable part is the policy name with dots as dashes, a letter first, cut to fit 63 characters.

    `suffix` is a DNS-1035 label tail such as `canary-g3` (lower-case letters, digits, dashes; short)."""
    plain = f"{policy}-{suffix}"
    if len(plain) <= MAX_LABEL and _DNS1035_LABEL.fullmatch(plain):
        return plain
    readable = re.sub(r"[^a-z0-9-]+", "-", policy.lower())
    if not readable[:1].isalpha():
        readable = f"{DIGIT_PREFIX}-{readable}"
    room = MAX_LABEL - len(suffix) - HASH_LENGTH - 2
    short = readable[:room].rstrip("-")
    return f"{short}-{digest(policy)}-{suffix}"


def label_value(text: str) -> str:
    """`text` as a label value: itself when valid, else its first characters and a hash of the whole (63 at most)."""
    if len(text) <= MAX_LABEL and _LABEL_VALUE.fullmatch(text):
        return text
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)
    head = readable[: MAX_LABEL - HASH_LENGTH - 1]
    head = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", head)
    return f"{head}-{digest(text)}" if head else digest(text)
