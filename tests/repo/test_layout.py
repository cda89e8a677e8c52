"""The tree keeps the promises tools and CI rely on."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _marks_module_integration(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return "integration" in ast.unparse(node.value)
    return False


def test_every_integration_test_module_carries_the_integration_marker() -> None:
    # `pytest -m "not integration"` must skip every test that starts a real Triton (or, in tests/cluster, needs
    # root to make network namespaces).
    modules = sorted(m for tier in ("integration", "cluster") for m in (TESTS / tier).glob("test_*.py"))
    assert modules
    unmarked = [m.name for m in modules if not _marks_module_integration(m)]
    assert not unmarked, f"add `pytestmark = pytest.mark.integration` to {', '.join(unmarked)}"


def test_no_unit_test_module_is_marked_integration() -> None:
    modules = [m for tier in ("unit", "mesh", "repo") for m in sorted((TESTS / tier).rglob("test_*.py"))]
    assert modules
    marked = [str(m.relative_to(TESTS)) for m in modules if _marks_module_integration(m)]
    assert not marked


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a file, relative ones resolved against its package."""
    package = path.relative_to(TESTS.parent).with_suffix("").parts[:-1]  # ("tests", "unit", "router")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            # `from . import x` imports the module x, `from .m import x` a name of m.
            names = [f"{module}.{alias.name}" for alias in node.names] if node.module is None else [module]
            found += [(node.lineno, name) for name in names]
    return found


def test_no_test_imports_another_tiers_module_only_tests_support() -> None:
    # Each folder under tests/ is a tier (unit, mesh, repo, integration, cluster); what two tiers share lives in
    # tests/support, so a tier can move, or run alone, without taking another's modules along.
    tiers = {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"unit", "mesh", "repo", "integration", "cluster", "support"} <= tiers
    crossing = []
    for path in sorted(TESTS.rglob("*.py")):
        tier = path.relative_to(TESTS).parts[0]
        if tier not in tiers:
            continue  # tests/__init__.py, conftest.py, and the models Triton runs
        for line, name in _imported_modules(path):
            parts = name.split(".")
            if parts[0] == "tests" and len(parts) > 1 and parts[1] not in (tier, "support"):
                crossing.append(f"{path.relative_to(TESTS.parent)}:{line} imports {name}")
    assert not crossing, "move what two tiers share into tests/support:\n" + "\n".join(crossing)
