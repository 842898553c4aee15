"""The modules of ``paratron/`` import each other without a cycle (docs/DESIGN.md: imports flow
one way). Function-level imports count too: a lazy import hides a cycle from Python, not from the
design."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "paratron"


def _module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The paratron modules that ``name`` imports (``from a import b`` counts ``a.b`` when that is
    a module, else ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = _module_names()
    return {name: _imports(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_and_function_level_imports_are_edges():
    graph = import_graph()
    assert "paratron.models.moe.layer" in graph["paratron.models.layer_spec"]  # inside a function
    assert "paratron.config.model_shape" in graph["paratron.config.validators"]  # from . import x


def test_no_import_cycle_between_paratron_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
