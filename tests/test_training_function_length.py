"""The training loop stays readable: no function in ``paratron/training/`` is longer than 60
lines (a screen), counted from ``def`` to its last line, docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

import paratron

LIMIT = 60


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_longest_training_function_fits_a_screen():
    root = Path(paratron.__file__).parent / "training"
    found = [(n, f"{p.name}:{line}", name) for p in sorted(root.glob("*.py"))
             for name, line, n in _functions(p)]
    assert len(found) > 20, "the walk found too few functions"
    longest = max(found)
    assert longest[0] <= LIMIT, f"{longest[2]} at {longest[1]} has {longest[0]} lines (limit {LIMIT})"
