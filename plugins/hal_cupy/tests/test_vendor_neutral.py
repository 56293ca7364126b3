"""The shared layer asks capability questions, never a vendor's name; hal-core ships no kernel source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1] / "src" / "hal_cupy"
CORE = Path(__file__).resolve().parents[3] / "src" / "hal_core"
VENDOR_NAMES = {"nvidia", "amd", "cuda", "rocm", "hip", "cpu", "intel"}
MODULES = sorted(SHARED.rglob("*.py"))


def _vendor_tests(tree: ast.AST) -> list[str]:
    """Comparisons with a vendor name, reads of ``.vendor`` and ``is_hip``: the ways code branches on a vendor."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for value in (node.left, *node.comparators):
                if isinstance(value, ast.Constant) and isinstance(value.value, str) \
                        and value.value.lower() in VENDOR_NAMES:
                    found.append(f"line {node.lineno}: compares with {value.value!r}")
        if isinstance(node, ast.Attribute) and node.attr in {"vendor", "is_hip"}:
            found.append(f"line {node.lineno}: reads .{node.attr}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in {"hal_cuda", "hal_rocm"}:
            found.append(f"line {node.lineno}: names the vendor plugin {node.value!r}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(SHARED)) for p in MODULES])
def test_shared_module_tests_no_vendor(path: Path) -> None:
    """No module of hal-cupy branches on a vendor name or imports a vendor plugin."""
    tree = ast.parse(path.read_text(), str(path))
    problems = _vendor_tests(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in {"hal_cuda", "hal_rocm"}:
            problems.append(f"line {node.lineno}: imports {node.module}")
        if isinstance(node, ast.Import):
            problems += [f"line {node.lineno}: imports {a.name}" for a in node.names
                         if a.name.split(".")[0] in {"hal_cuda", "hal_rocm"}]
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_check_finds_a_vendor_branch() -> None:
    """The detector itself: a vendor comparison, a .vendor read and is_hip are all reported."""
    code = 'if caps.vendor == "nvidia":\n    pass\nif rt.is_hip:\n    pass\n'
    assert len(_vendor_tests(ast.parse(code))) == 3


def test_core_ships_no_kernel_source() -> None:
    """src/hal_core holds no .cu or .cuh file: kernel sources are hal-cupy's, preludes their vendor's."""
    assert CORE.is_dir()
    assert sorted(p.name for p in CORE.rglob("*.cu*")) == []
