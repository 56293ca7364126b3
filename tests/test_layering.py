"""Layers import only down: no package of the repository has an import cycle, and hal-core's plugin contract
imports nothing of hal-core above it at run time (imports under ``if TYPE_CHECKING:`` never run and do not count;
an import inside a function does)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "src" / "hal_core",
            *sorted(p.parent for p in (ROOT / "plugins").glob("*/src/hal_*/__init__.py"))]

#: hal-core's bottom layers (docs/architecture.md): the plugin contract, then values, errors and settings.
CONTRACT = ("_backend", "_device", "_stream", "_memory", "_launch")
BASE = (*CONTRACT, "arrays", "_capabilities", "_errors", "_env", "env", "_env_guard", "_hookspecs")


def _modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return hidden


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports at run time (``from pkg import submodule`` counts
    as the submodule only; a name from a package counts as that package's ``__init__``)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                subs = [f"{source}.{alias.name}" for alias in node.names]
                found = [sub for sub in subs if sub in modules]
                if len(found) < len(subs):
                    found.append(source)
            else:
                continue
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_has_no_import_cycle(package: Path) -> None:
    """Every run-time import inside the package points one way: no module imports one that imports it back."""
    graph = import_graph(package)
    assert len(graph) > 3, f"no modules read from {package}"
    cycle = find_cycle(graph)
    assert cycle is None, f"{package.name}: import cycle {' -> '.join(cycle or [])}"


def test_contract_imports_only_values_errors_and_settings() -> None:
    """hal-core's contract modules (Backend, devices, streams, memory, launch) import no layer above them."""
    graph = import_graph(ROOT / "src" / "hal_core")
    allowed = {f"hal_core.{name}" for name in BASE}
    above = {f"hal_core.{name}": sorted(graph[f"hal_core.{name}"] - allowed) for name in CONTRACT}
    assert all(not targets for targets in above.values()), above
    assert "hal_core._device" in graph["hal_core._backend"]  # the graph does see the contract's own imports


def test_cycle_finder_sees_lazy_imports_and_ignores_type_checking(tmp_path: Path) -> None:
    """A cycle closed by an import inside a function is found; one closed only under TYPE_CHECKING is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from . import b\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from .a import A\n    return A\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (package / "d.py").write_text("from pkg import c\n")
    graph = import_graph(package)
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (package / "b.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(package)) is None
