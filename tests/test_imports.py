"""The modules of ``paratron/`` import each other without a cycle (docs/DESIGN.md: imports flow
one way), and so do its packages (docs/ARCHITECTURE.md: the layers). Function-level imports count
too: a lazy import hides a cycle from Python, not from the design; and a paratron module imports
another paratron module at its top, except where :data:`LAZY_ALLOWED` says why not."""

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


def _function_imports(path: Path) -> list[tuple[str, int, str]]:
    """``(function, line, imported module)`` of each paratron import inside a function body."""
    out = []

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if fn is not None and isinstance(child, ast.ImportFrom) and (
                    child.level or (child.module or "").split(".")[0] == "paratron"):
                out.append((fn, child.lineno, "." * child.level + (child.module or "")))
            elif fn is not None and isinstance(child, ast.Import):
                out.extend((fn, child.lineno, a.name) for a in child.names if a.name.split(".")[0] == "paratron")
            visit(child, inner)

    visit(ast.parse(path.read_text()), None)
    return out


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


def package_of(module: str) -> str:
    """The top-level part of paratron a module belongs to: ``paratron.models.moe.layer`` ->
    ``paratron.models``; a top-level module (``paratron.errors``) is its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between top-level packages (edges inside one package dropped)."""
    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        if name == "paratron":
            continue
        out.setdefault(package_of(name), set()).update(package_of(d) for d in deps if package_of(d) != package_of(name))
    return out


def test_package_graph_sees_a_cycle():
    graph = {"paratron.a.x": {"paratron.b.y"}, "paratron.b.y": {"paratron.c"}, "paratron.c": {"paratron.a.z"},
             "paratron.a.z": set()}
    assert find_cycle(package_graph(graph)) == ["paratron.a", "paratron.b", "paratron.c", "paratron.a"]
    graph["paratron.c"] = set()
    assert find_cycle(package_graph(graph)) is None


def test_no_import_cycle_between_paratron_packages():
    graph = package_graph(import_graph())
    cycle = find_cycle(graph)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)
    # config is a leaf: it reaches no package but the base modules (errors, markup).
    assert graph["paratron.config"] <= {"paratron.errors", "paratron.markup"}, graph["paratron.config"]
    assert "paratron.config" not in graph["paratron.registry"]


LAZY_ALLOWED: dict[str, str] = {
}
"""``path:function -> imported module`` of the paratron imports allowed inside a function, each
with its reason in a comment. ``cli.py`` picks its subcommand's module with ``importlib`` (no
import statement); heavy optional libraries (transformers, datasets, peft, wandb, torchao) are
not paratron modules and are not listed."""


def test_paratron_imports_sit_at_the_top_of_each_module():
    found = {f"{path.relative_to(PACKAGE.parent)}:{fn}": module
             for path in sorted(PACKAGE.rglob("*.py")) for fn, line, module in _function_imports(path)}
    new = sorted(f"{k} imports {v}" for k, v in found.items() if k not in LAZY_ALLOWED)
    assert not new, "paratron import inside a function (move it to the top of the module):\n" + "\n".join(new)


def test_lazy_import_finder_sees_nested_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom paratron import config\ndef a():\n    def b():\n        from . import x\n"
                 "    import paratron.rules\n    import json\n")
    assert _function_imports(f) == [("b", 5, "."), ("a", 6, "paratron.rules")]
