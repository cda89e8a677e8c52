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
    # `pytest -m "not integration"` must skip every test that starts a real Triton.
    modules = sorted((TESTS / "integration").glob("test_*.py"))
    assert modules
    unmarked = [m.name for m in modules if not _marks_module_integration(m)]
    assert not unmarked, f"add `pytestmark = pytest.mark.integration` to {', '.join(unmarked)}"


def test_no_unit_test_module_is_marked_integration() -> None:
    marked = [m.name for m in sorted((TESTS / "unit").glob("test_*.py")) if _marks_module_integration(m)]
    assert not marked
