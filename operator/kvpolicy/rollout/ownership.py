"""One target, one policy: which KVPolicy governs a Deployment when several name it.

The one created first governs it (ties: the name first in order), as the Gateway API settles routes that claim the
same thing. Read from the policies alone, so every pass of every policy reaches the same answer without a lock, and
writes nothing to the target. A policy still being deleted keeps its claim until it is gone, so its cleanup and the
next policy never act on the target at once. The API server cannot refuse the second policy at admission: a CEL rule
sees one object, never the other policies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Where a policy names its target: the observer lists only the policies naming the same one (a cache indexes it).
TARGET_NAME_PATH = ("spec", "targetRef", "name")


def target_name(policy: Mapping[str, Any]) -> str | None:
    """spec.targetRef.name as stored, read without validating the rest of the spec (an invalid policy keeps its claim:
    it may be fixed)."""
    target_ref = (policy.get("spec") or {}).get("targetRef")
    name = target_ref.get("name") if isinstance(target_ref, Mapping) else None
    return name if isinstance(name, str) and name else None


def _seniority(policy: Mapping[str, Any]) -> tuple[str, str]:
    meta = policy.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def governing_policy(metadata: Mapping[str, Any], target: str, peers: Sequence[Mapping[str, Any]]) -> str | None:
    """The name of the other KVPolicy (among `peers`, the policies of the namespace, or those of them naming
    `target`) that governs `target`, the Deployment of the policy with this `metadata`; None when this policy does."""
    me: Mapping[str, Any] = {"metadata": metadata}
    uid = metadata.get("uid")
    others = [peer for peer in peers if target_name(peer) == target and (peer.get("metadata") or {}).get("uid") != uid]
    first = min([me, *others], key=_seniority)
    return None if first is me else str(first["metadata"]["name"])
