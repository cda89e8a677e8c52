"""No function in services/ or gateway/ over 60 lines, or over 6 parameters, unless its signature says why.

A function is counted from its ``def`` line to its last line (decorators
not counted, its docstring and comments counted). One that must be longer
(an argparse table, say) carries ``# long: <why>`` on a line of its
signature, from the ``def`` to the colon that opens its body::

    def build_parser() -> argparse.ArgumentParser:  # long: an argparse table, a flag per line

A function taking more than 6 parameters (``self`` and ``cls`` not counted)
carries ``# wide: <why>`` on its signature the same way: a state that travels
together is one object, not loose arguments.

Cyclomatic complexity (at most 12) is ruff's C901, set in pyproject.toml;
a function exempt from it says why in its ``# noqa: C901 - <why>``.
Generated code (``services/tokenmesh/v1``) is not checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("services", "gateway")
GENERATED = ROOT / "services" / "tokenmesh" / "v1"
MAX_LINES = 60
MARKER = re.compile(r"#\s*long:\s*\S")
"""The why-marker: ``# long:`` followed by the reason."""
MAX_PARAMETERS = 6
WIDE = re.compile(r"#\s*wide:\s*\S")
"""The why-marker of a function with more parameters: ``# wide:`` followed by the reason."""


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (args.vararg is not None) + (args.kwarg is not None)


def wide_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, def line, parameters) of each function in source over MAX_PARAMETERS without the why-marker."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _parameters(node) > MAX_PARAMETERS:
            signature = lines[node.lineno - 1 : node.body[0].lineno - 1] or [lines[node.lineno - 1]]
            if not any(WIDE.search(line) for line in signature):
                found.append((node.name, node.lineno, _parameters(node)))
    return sorted(found, key=lambda item: item[1])


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, def line, lines) of each function in source over max_lines without the why-marker."""
    lines = source.splitlines()
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                signature = lines[child.lineno - 1 : child.body[0].lineno - 1] or [lines[child.lineno - 1]]
                if size > max_lines and not any(MARKER.search(line) for line in signature):
                    found.append((name, child.lineno, size))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _checked_files() -> list[Path]:
    return sorted(path for top in CHECKED for path in (ROOT / top).rglob("*.py") if GENERATED not in path.parents)


def test_no_function_in_services_or_gateway_is_over_60_lines_without_saying_why() -> None:
    files = _checked_files()
    assert len(files) > 50  # the walk found the packages
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name} ({size} lines)"
        for path in files
        for name, line, size in long_functions(path.read_text())
    ]
    assert not offenders, (
        f"functions over {MAX_LINES} lines: split them into named steps, or put '# long: <why>' on the def line:\n"
        + "\n".join(offenders)
    )


def _function(name: str, body_lines: int, def_line: str = "") -> str:
    header = def_line or f"def {name}() -> None:"
    return header + "\n" + "".join(f"    x{i} = {i}\n" for i in range(body_lines))


def test_the_check_counts_from_the_def_line_and_names_nested_and_method_functions() -> None:
    source = "\n".join(
        [
            _function("fits", 59),  # 60 lines with its def
            _function("over", 60),
            "class Owner:",
            "    " + _function("method", 70).replace("\n", "\n    "),
            "@decorated",
            _function("outer", 3) + "    " + _function("inner", 61).replace("\n", "\n    "),
        ]
    )
    assert [(name, size) for name, _, size in long_functions(source)] == [
        ("over", 61),
        ("Owner.method", 71),
        ("outer", 66),
        ("outer.inner", 62),
    ]


def test_the_why_marker_on_the_signature_exempts_a_long_function_and_a_bare_marker_does_not() -> None:
    marked = _function("table", 80, "def table() -> None:  # long: an argparse table")
    split_signature = _function("wide", 80, "def wide(\n    a: int,\n) -> None:  # long: one flag per line")
    bare = _function("bare", 80, "def bare() -> None:  # long:")
    in_body = _function("body", 80) + "    # long: said too late\n"
    found = [name for name, _, _ in long_functions("\n".join([marked, split_signature, bare, in_body]))]
    assert found == ["bare", "body"]


def test_no_function_in_services_or_gateway_takes_over_6_parameters_without_saying_why() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name} ({count} parameters)"
        for path in _checked_files()
        for name, line, count in wide_functions(path.read_text())
    ]
    assert not offenders, (
        f"functions over {MAX_PARAMETERS} parameters: pass one object for what travels together, or put "
        "'# wide: <why>' on the signature:\n" + "\n".join(offenders)
    )


def test_the_parameter_check_skips_self_counts_star_args_and_takes_the_marker() -> None:
    source = "\n".join(
        [
            "class C:",
            "    def six(self, a, b, c, d, e, f): pass",
            "    def seven(self, a, b, c, d, e, f, *, g): pass",
            "def star(a, b, c, d, e, *args, **kwargs): pass",
            "def marked(a, b, c, d, e, f, g):  # wide: a wire format's fields",
            "    pass",
            "def bare(a, b, c, d, e, f, g):  # wide:",
            "    pass",
        ]
    )
    assert [(name, count) for name, _, count in wide_functions(source)] == [("seven", 7), ("star", 7), ("bare", 7)]
