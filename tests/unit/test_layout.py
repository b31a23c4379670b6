"""The package layout docs/ARCHITECTURE.md draws: dependencies between the packages of
``daemon/inferd`` point one way (no cycle), the wire protocol depends on neither side,
and no module grows past the size DESIGN.md allows without saying why."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "daemon" / "inferd"
WIRE = REPO / "clients" / "inferd_wire"
MAX_MODULE_LINES = 450


def _modules(root: Path) -> Iterator[Path]:
    yield from sorted(root.rglob("*.py"))


def _imported_modules(path: Path, package: str) -> Iterator[str]:
    """Every ``package.…`` module ``path`` imports, at top level or inside a function,
    with relative imports resolved."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    here = parts[:-1]  # the package of a module and of an __init__ alike
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                name = ".".join((*base, node.module or ""))
            else:
                name = node.module or ""
            yield name.rstrip(".")
            yield from (f"{name}.{alias.name}" for alias in node.names)


def _unit(module: str) -> str | None:
    """The layout unit a dotted ``inferd.…`` name belongs to: its first component."""
    parts = module.split(".")
    if parts[0] != "inferd" or len(parts) < 2:
        return None
    return (
        parts[1]
        if (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()
        else None
    )


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _modules(PACKAGE):
        source = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        edges = graph.setdefault(source, set())
        for module in _imported_modules(path, "inferd"):
            target = _unit(module)
            if target is not None and target != source:
                edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_between_the_packages_of_inferd() -> None:
    graph = package_graph()
    assert {"serving", "engine_build", "runtime", "supervision", "cli"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_only_the_cli_imports_the_composition_root_and_nothing_imports_the_cli() -> None:
    graph = package_graph()
    for top, allowed in (("daemon", ["cli"]), ("cli", [])):
        users = sorted(source for source, targets in graph.items() if top in targets)
        assert users == allowed, f"inferd.{top} is imported by {users}"


def test_types_and_errors_import_nothing_of_inferd() -> None:
    graph = package_graph()
    assert graph["types"] <= {"errors"} and graph["errors"] == set()


def test_the_wire_protocol_depends_on_neither_the_daemon_nor_the_client() -> None:
    for path in _modules(WIRE):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                assert name.split(".")[0] not in {"inferd", "inferd_client"}, (path, name)


def _sizes_allowed_by_design() -> set[str]:
    """Paths DESIGN.md's "Modules over 450 lines" entry names (backticked)."""
    design = (REPO / "docs" / "DESIGN.md").read_text()
    entry = re.search(
        r"\*\*Modules over 450 lines\.\*\*(.*?)(?:\n\d+\. \*\*|\n## |\Z)", design, re.S
    )
    assert entry is not None, "DESIGN.md lost its 'Modules over 450 lines' entry"
    return set(re.findall(r"`(daemon/inferd/[\w/]+\.py)`", entry.group(1)))


def test_no_module_is_over_450_lines_unless_design_says_why() -> None:
    allowed = _sizes_allowed_by_design()
    too_long = {
        str(path.relative_to(REPO)): lines
        for path in _modules(PACKAGE)
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert {path: n for path, n in too_long.items() if path not in allowed} == {}
