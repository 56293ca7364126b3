"""The plugin contract is public and complete, and hal-core names no vendor."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

import hal_core
from hal_core import Backend, DeviceHandle

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "hal_core"
#: Vendor names hal-core must not use in code (comments and docstrings may explain the contract).
VENDOR = re.compile(r"(?<![A-Za-z0-9])(cuda|cupy|nvidia|rocm|hip|amd)(?![A-Za-z0-9])", re.IGNORECASE)


def _code_without_comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every token of ``path`` that is neither a comment nor a docstring."""
    text = path.read_text()
    docstrings: set[tuple[int, int]] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add((body[0].lineno, body[0].col_offset))
    found = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if token.type == tokenize.STRING and token.start in docstrings:
            continue
        found.append((token.start[0], token.string))
    return found


def _core_sources() -> list[Path]:
    return [p for p in sorted(CORE.rglob("*.py")) if "kernels" not in p.relative_to(CORE).parts[:1]]


def test_hal_core_names_no_vendor_in_code() -> None:
    """No .py file of src/hal_core uses cuda, cupy, nvidia, rocm, hip or amd outside comments and docstrings."""
    hits = []
    for path in _core_sources():
        for line, text in _code_without_comments_and_docstrings(path):
            if VENDOR.search(text):
                hits.append(f"{path.relative_to(ROOT)}:{line}: {text[:80]}")
    assert not hits, "vendor names in hal-core code:\n" + "\n".join(hits)


def test_vendor_scan_finds_a_vendor_name_in_code(tmp_path: Path) -> None:
    """The scan itself sees a vendor name in code and ignores it in a comment or docstring."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""Talks about CUDA."""\n# cupy here is fine\nkind = "rocm"\nx = __cuda_array_interface__\n')
    code = [text for _, text in _code_without_comments_and_docstrings(sample)]
    assert [t for t in code if VENDOR.search(t)] == ['"rocm"', "__cuda_array_interface__"]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_no_plugin_imports_a_private_hal_core_module() -> None:
    """The plugins' sources and tests import only public hal_core modules."""
    files = sorted((ROOT / "plugins").glob("*/src/**/*.py")) + sorted((ROOT / "plugins").glob("*/tests/**/*.py"))
    assert files, "no plugin sources found"
    private = re.compile(r"^hal_core(\.[A-Za-z0-9]+)*\._")
    hits = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in _imports(p) if private.match(name)]
    assert not hits, "plugins importing private hal_core modules:\n" + "\n".join(hits)


PUBLIC_MODULES = ["hal_core", "hal_core.ops", "hal_core.arrays", "hal_core.quant", "hal_core.kvcache"]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_names_report_a_public_module(module: str) -> None:
    """Every public class and function reports the public module it is documented in, never a private one."""
    import importlib

    mod = importlib.import_module(module)
    for name in mod.__all__:
        value = getattr(mod, name)
        if not (isinstance(value, type) or callable(value)):
            continue
        home = getattr(value, "__module__", module)
        if home.startswith("pluggy"):  # hookimpl/hookspec are pluggy's marker objects
            continue
        assert not any(part.startswith("_") for part in home.split(".")), (module, name, home)


def test_unused_api_is_gone() -> None:
    """Dead API was removed: PluginRejectedError, Backend.api_version. (``OpCall.with_args`` came back with a use:
    the call a planned runner makes per call, tests/test_core_bound_plans.py.)"""
    assert not hasattr(hal_core, "PluginRejectedError")
    assert not hasattr(Backend, "api_version")


def test_contract_declares_host_dlpack_and_current_stream() -> None:
    """is_host, dlpack_device_types, from_dlpack and on_reset are declared; current_stream is a method."""
    assert Backend.is_host is False and Backend.dlpack_device_types == frozenset()
    assert callable(Backend.from_dlpack) and callable(Backend.on_reset)
    assert callable(DeviceHandle.current_stream) and not isinstance(DeviceHandle.__dict__["current_stream"], property)


def test_host_backend_from_dlpack_is_a_numpy_view_and_device_backends_must_implement_it() -> None:
    """A host backend inherits a zero-copy numpy import; a device backend that lists types must bring its own."""
    from halfakes import HostBackend

    host = HostBackend()
    array = np.arange(6, dtype=np.float32)
    view = host.from_dlpack(array)
    assert np.shares_memory(view, array)

    class DeviceLike(HostBackend):
        name = "device-like"
        is_host = False
        dlpack_device_types = frozenset({2})

    with pytest.raises(NotImplementedError, match="does not implement from_dlpack"):
        DeviceLike().from_dlpack(array)


def test_cpu_plugin_is_a_host_backend_with_a_current_stream_method(cpu) -> None:
    """hal-cpu declares is_host, and its device's current_stream() is the default stream outside `with`."""
    assert cpu.is_host is True
    device = cpu.device(0)
    assert device.current_stream() is device.default_stream


ON_RESET = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend, touch


class ResettableBackend(HostBackend):
    name = "resettable"
    priority = 3

    def on_reset(self):
        touch("{marker}", "r")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [ResettableBackend]
'''


def test_reset_calls_on_reset_of_every_bound_backend_and_forgets_it(make_plugin) -> None:
    """hal_core.reset() calls on_reset() once per bound backend, then binds a fresh instance."""
    plugin = make_plugin("resettable", ON_RESET)
    first = hal_core.get_backend("resettable")
    assert plugin.ran() == 0
    hal_core.reset()
    assert plugin.ran() == 1
    assert hal_core.get_backend("resettable") is not first
    hal_core.reset()
    assert plugin.ran() == 2
    hal_core.reset()  # nothing bound: no call
    assert plugin.ran() == 2
