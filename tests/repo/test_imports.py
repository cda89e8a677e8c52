"""The import structure of services/ and gateway/: no module imports, however indirectly, itself.

The graph is built with ``ast`` from every import statement: at module level,
inside functions, and under ``if TYPE_CHECKING:`` (a type-checking back-import
is still a dependency a reader has to follow both ways, and mypy resolves it).

An edge goes to the module an import names: ``from a.b import c`` is an edge to
``a.b.c`` when that is a module, else to ``a.b`` (its ``__init__``). Importing
``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but those implied edges
are left out: a package whose ``__init__`` re-exports its private modules would
otherwise form a "cycle" with each of them (``tokenmesh.router`` ->
``tokenmesh.router._service`` -> ``tokenmesh.router``) that Python resolves
without a partly initialised module, and that no reader walks. A package
``__init__`` counts when a module imports it by name: ``from tokenmesh.router
import X`` inside ``tokenmesh.router._pool`` is a real cycle through the
re-exports, and is reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (ROOT / "services", ROOT / "gateway")
PACKAGES = ("tokenmesh", "tokenmesh_gateway")


def _modules() -> dict[str, Path]:
    """Every module of our packages by dotted name (a package by its own name, for its ``__init__``)."""
    found: dict[str, Path] = {}
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[0] not in PACKAGES:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The modules of ours that ``module`` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    yield f"{base}.{alias.name}"
                elif base in known:
                    yield base


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports."""
    known = _modules()
    return {name: set(_imported(name, path, known)) - {name} for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), as a path a -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_within(graph, component) for component in components]


def _path_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first), for the failure message."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_graph_sees_imports_in_functions_and_under_type_checking(tmp_path: Path) -> None:
    # The checker itself: a back-import hidden in either place must show up as an edge.
    graph = import_graph()
    assert "tokenmesh.router._config" in graph["tokenmesh.router._service"]  # module level
    assert "tokenmesh_gateway" in graph["tokenmesh.cli"]  # inside build_parser()
    module = tmp_path / "_metrics.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._owner import Owner\n"
        "def f():\n    import tokenmesh.config\n"
    )
    known = {"tokenmesh.x._owner": module, "tokenmesh.config": module}
    assert set(_imported("tokenmesh.x._metrics", module, known)) == {"tokenmesh.x._owner", "tokenmesh.config"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_of_services_or_gateway_imports_itself_through_others() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (break them by passing the parts a module reads, not its owner):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


def test_the_gateway_never_reaches_the_command_line_or_the_mesh_launcher() -> None:
    # `tokenmesh up` starts the gateway as a child process (`python -m tokenmesh gateway`, as every service), and
    # `tokenmesh gateway` imports the gateway package: the one edge between the packages that points at the gateway
    # starts at the entry point. Nothing the gateway imports, however indirectly, may lead back to it.
    graph = import_graph()
    reached: set[str] = set()
    frontier = [m for m in graph if m.split(".")[0] == "tokenmesh_gateway"]
    while frontier:
        module = frontier.pop()
        if module not in reached:
            reached.add(module)
            frontier.extend(graph[module])
    assert not reached & {"tokenmesh.cli", "tokenmesh.mesh", "tokenmesh.__main__"}
    into_gateway = {
        m
        for m, targets in graph.items()
        if m.split(".")[0] == "tokenmesh" and any(t.split(".")[0] == "tokenmesh_gateway" for t in targets)
    }
    assert into_gateway == {"tokenmesh.cli"}
