"""The package's layers (docs/architecture.md): no import cycle in operator/, and the pure rollout core loads no I/O
library when imported. The room-to-room rules themselves are import-linter contracts (.importlinter, `make lint`)."""

import subprocess
import sys
from collections.abc import Mapping, Set

import grimp

PURE_MODULES = ("kvpolicy.rollout.step", "kvpolicy.rollout.metric_checks", "kvpolicy.planning.planner")
IO_LIBRARIES = ("aiohttp", "kopf", "kubernetes_asyncio", "kubernetes")


def import_cycles(imports: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted: every group holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in imports.get(module, ()):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return groups


def test_the_operator_has_no_import_cycle() -> None:
    graph = grimp.build_graph("kvpolicy")  # TYPE_CHECKING imports count: they are a dependency all the same
    imports = {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    assert import_cycles(imports) == []


def test_the_cycle_search_finds_a_cycle_through_three_modules() -> None:
    imports = {"a.check": {"a.served"}, "a.served": {"a.checks"}, "a.checks": {"a.check", "a.model"}, "a.model": set()}
    assert import_cycles(imports) == [["a.check", "a.checks", "a.served"]]


def test_the_pure_core_loads_no_io_library() -> None:
    script = (
        f"import sys\nfor name in {PURE_MODULES!r}: __import__(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {IO_LIBRARIES!r}))"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
