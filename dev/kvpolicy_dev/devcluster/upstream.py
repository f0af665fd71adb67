"""The upstream CRD manifests the emulated API server serves, kept in `upstream_crds/` (sources in its README)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

UPSTREAM_CRDS = Path(__file__).with_name("upstream_crds")


def upstream_crd(filename: str) -> dict[str, Any]:
    """One upstream CRD manifest (YAML, or JSON, which YAML reads too), freshly loaded: the caller may change it."""
    loaded: dict[str, Any] = yaml.safe_load((UPSTREAM_CRDS / filename).read_text(encoding="utf-8"))
    return loaded
