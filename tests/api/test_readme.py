"""The README's generated parts stay in step with the code."""

from __future__ import annotations

import itertools
from pathlib import Path

from kvpolicy.api.crd import reference_markdown

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_readme_embeds_the_current_kvpolicy_reference() -> None:
    start, end = "<!-- reference:start -->\n", "<!-- reference:end -->"
    embedded = README.split(start, 1)[1].split(end, 1)[0]
    assert embedded.strip() == reference_markdown().strip(), "README reference is stale: `kvpolicy crd --reference`"


def test_readme_example_table_matches_the_planner() -> None:
    from test_planner import EXPECTED

    for example, by_gpu in EXPECTED.items():
        row = next(line for line in README.splitlines() if line.startswith(f"| `{example}`"))
        cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
        assert cells == [by_gpu[g] for g in ("H100", "H200", "B200", "A100", "L40S")], example


def test_readme_embeds_the_attention_backend_table() -> None:
    from kvpolicy.planning.attention import table_markdown

    start, end = "<!-- backends:start -->\n", "<!-- backends:end -->"
    embedded = README.split(start, 1)[1].split(end, 1)[0]
    assert embedded.strip() == table_markdown().strip(), "README backend table is stale: kvpolicy.planning.attention"


def test_readme_embeds_the_vllm_version_table() -> None:
    from kvpolicy.planning.vllm_versions import table_markdown

    start, end = "<!-- versions:start -->\n", "<!-- versions:end -->"
    embedded = README.split(start, 1)[1].split(end, 1)[0]
    assert embedded.strip() == table_markdown().strip(), (
        "README version table is stale: kvpolicy.planning.vllm_versions"
    )


def test_readme_lists_every_gpu_name_plan_takes() -> None:
    from kvpolicy.planning.gpu import PRODUCTS

    listed = README.split("`--gpu` takes every GPU the", 1)[1].split(")", 1)[0]
    assert [name.strip() for name in listed.split(":", 1)[1].split(",")] == [p.name for p in PRODUCTS]


def _table_headers(markdown: str) -> set[str]:
    lines = markdown.splitlines()
    return {
        " ".join(line.split())
        for line, below in itertools.pairwise(lines)
        if line.startswith("|") and below.startswith("|---")
    }


def test_each_table_lives_in_one_document() -> None:
    """A table copied into a second document drifts from the first (the docs' copies of the README's tables had):
    each table is written once and linked to from elsewhere."""
    root = Path(__file__).resolve().parents[2]
    documents = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "monitoring").glob("*.md"))]
    seen: dict[str, Path] = {}
    for document in documents:
        for header in _table_headers(document.read_text(encoding="utf-8")):
            assert header not in seen, f"the table {header!r} is in {seen[header].name} and {document.name}"
            seen[header] = document
