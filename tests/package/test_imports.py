"""The package's import graph: no cycles, and no torch where pytest loads the plugin.

The graph is read from the source with `ast`. For the harness (everything but the runtime) it holds
every import a module can make, also the ones inside functions that run later: a cycle through a
lazy import is a cycle all the same, it only fails later. The runtime's graph is checked at import
time (module-level imports). Imports under `if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> the package it is installed as (pyproject's package-dir).
PACKAGES = {
    "pytest_graphmode": "pytest_graphmode",
    "runtime": "pytest_graphmode.runtime",
    "strategies": "pytest_graphmode.strategies",
}
RUNTIME = "pytest_graphmode.runtime"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, module: str, is_package: bool, lazy: bool = True) -> set[str]:
    """Every module name an import in `tree` names; `lazy`: also imports inside functions."""
    names: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return names


def import_graph(*, lazy: bool) -> dict[str, set[str]]:
    """module -> the package modules it imports (`lazy`: also inside functions)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _imported(tree, name, path.name == "__init__.py", lazy)
        # `from a.b import c` depends on the module a.b.c where there is one, else on a.b.
        graph[name] = {
            target
            for target in imported
            if target in modules
            and target != name
            and not any(other.startswith(target + ".") for other in imported if other in modules)
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _describe(found: list[list[str]]) -> str:
    return "import cycles (each line: modules that import one another):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_the_harness_has_no_import_cycles_not_even_through_lazy_imports() -> None:
    graph = import_graph(lazy=True)
    harness = {
        module: {t for t in targets if not t.startswith(RUNTIME)}
        for module, targets in graph.items()
        if not module.startswith(RUNTIME)
    }
    found = cycles(harness)
    assert not found, _describe(found)


def test_the_package_has_no_import_cycles_at_import_time() -> None:
    found = cycles(import_graph(lazy=False))
    assert not found, _describe(found)


def test_the_cycle_finder_sees_a_cycle_through_a_lazy_import() -> None:
    tree = ast.parse("def later():\n    from pytest_graphmode import fixtures\n")
    assert "pytest_graphmode.fixtures" in _imported(tree, "pytest_graphmode.plugin", False)
    assert not _imported(tree, "pytest_graphmode.plugin", False, lazy=False)
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", ["pytest_graphmode.plugin", "pytest_graphmode.settings"])
def test_start_up_modules_import_neither_torch_nor_hypothesis(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in ('torch', 'hypothesis') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
