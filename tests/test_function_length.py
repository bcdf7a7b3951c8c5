"""No function of the package, the launchers, the benchmarks or the data tools is over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("dflash2", "launch", "benchmarks", "data_prep")
MAX_LINES = 60


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, number of lines) of every function over `max_lines`, decorators excluded."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > max_lines
    ]


def test_the_check_sees_a_long_function_and_a_nested_one():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    method_body = body.replace("\n", "\n    ")
    source = f"def long():\n{body}\n\n\ndef short():\n    pass\n\n\nclass A:\n    def method(self):\n    {method_body}\n"
    assert [(name, lines) for name, _, lines in long_functions(source)] == [("long", 61), ("method", 61)]
    assert long_functions("def f():\n" + "\n".join(f"    x{i} = {i}" for i in range(59))) == []


def test_no_function_over_60_lines():
    found = [
        f"{path.relative_to(REPO)}:{line} {name} ({lines} lines)"
        for folder in FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
        for name, line, lines in long_functions(path.read_text())
    ]
    assert not found, "split these functions (at most 60 lines each):\n" + "\n".join(found)
