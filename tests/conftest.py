"""Shared fixtures: a clean hal state per test, and real throwaway plugin distributions.

``make_plugin`` writes ``<dist>-<version>.dist-info/`` (METADATA and an
``entry_points.txt`` in group ``hal``) and the plugin module into a
temporary site folder on ``sys.path``, so ``importlib.metadata`` really
discovers it; nothing about discovery is mocked.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from halfakes import HAL_VARS

import hal_core

HERE = Path(__file__).resolve().parent

#: Source of a plugin module offering one :class:`halfakes.HostBackend` subclass.
DEFAULT_SOURCE = '''
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


class {cls}(HostBackend):
    name = {backend!r}
    priority = {priority!r}


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [{cls}]
'''


@dataclass
class Plugin:
    """A throwaway plugin distribution written by ``make_plugin``."""

    name: str  #: the entry point name
    module: str
    distribution: str
    version: str
    site: Path
    marker: Path  #: a file the plugin's code may append to, to prove it ran

    def ran(self) -> int:
        """How many times the plugin appended to its marker."""
        return len(self.marker.read_text()) if self.marker.exists() else 0


@pytest.fixture(autouse=True)
def clean_hal(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends with no HAL_* variable, no discovery state and no fallback log."""
    for var in HAL_VARS:
        monkeypatch.delenv(var, raising=False)
    hal_core.reset()
    yield
    hal_core.reset()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder on ``sys.path`` holding throwaway distributions (and ``halfakes``)."""
    folder = tmp_path / "site"
    folder.mkdir()
    shutil.copy(HERE / "halfakes.py", folder / "halfakes.py")
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.fixture
def make_plugin(site: Path) -> Iterator[Callable[..., Plugin]]:
    """Install a throwaway plugin distribution; ``make_plugin(name, source=None, ...)``.

    ``source`` is the module's text (``{marker}`` is replaced by the marker
    file's path); without it the module offers one ``HostBackend`` named
    ``backend`` (default: ``name``) at ``priority``. ``module=None`` with
    ``write_module=False`` leaves the entry point's module missing.
    """
    modules: list[str] = []

    def make(
        name: str,
        source: str | None = None,
        *,
        backend: str | None = None,
        priority: int = 10,
        version: str = "0.0.1",
        distribution: str | None = None,
        module: str | None = None,
        write_module: bool = True,
    ) -> Plugin:
        module = module or f"hal_throwaway_{name.replace('-', '_')}"
        distribution = distribution or f"hal-throwaway-{name}"
        marker = site / f"{module}.marker"
        if source is None:
            cls = "".join(part.title() for part in (backend or name).replace("-", "_").split("_")) + "Backend"
            source = DEFAULT_SOURCE.format(cls=cls, backend=backend or name, priority=priority)
        info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[hal]\n{name} = {module}\n")
        if write_module:
            text = textwrap.dedent(source).replace("{marker}", str(marker))
            (site / f"{module}.py").write_text(text)
        modules.append(module)
        importlib.invalidate_caches()
        hal_core.reset()
        return Plugin(name, module, distribution, version, site, marker)

    yield make
    for module in modules:
        sys.modules.pop(module, None)
    sys.modules.pop("halfakes", None)


def _cpu_importable() -> bool:
    try:
        import hal_cpu  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def cpu() -> hal_core.Backend:
    """The real CPU backend (skips while hal-cpu is not installed)."""
    if not _cpu_importable():
        pytest.skip("hal-cpu is not installed (pip install -e plugins/hal_cpu)")
    return hal_core.get_backend("cpu")


def _cpu_reporting(monkeypatch: pytest.MonkeyPatch, features: set[str]) -> Iterator[hal_core.Backend]:
    if not _cpu_importable():
        pytest.skip("hal-cpu is not installed (pip install -e plugins/hal_cpu)")
    import hal_cpu._device as hal_cpu_device

    from hal_core.ops._device_features import forget_device_features

    monkeypatch.setattr(hal_cpu_device, "_kernel_features", lambda: set(features))
    forget_device_features()
    yield hal_core.get_backend("cpu")
    forget_device_features()


@pytest.fixture
def int8_dot_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[hal_core.Backend]:
    """The CPU backend reporting int8 dot products whatever this CPU has (what the ``activations="auto"`` rules
    read), so their int8 branch is tested on every machine; the kernels run whatever variant this CPU runs."""
    yield from _cpu_reporting(monkeypatch, {"int8_dot"})


@pytest.fixture
def plain_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[hal_core.Backend]:
    """The CPU backend reporting no int8 dot products (the baseline kernel variant)."""
    yield from _cpu_reporting(monkeypatch, set())


@pytest.fixture
def only_cpu_real(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Disable every installed real plugin but ``cpu`` (plus ``extra`` names), so hardware cannot win."""

    def disable(*extra: str) -> None:
        eps = metadata.entry_points(group="hal")
        real = {ep.name for ep in eps if not ep.value.startswith("hal_throwaway_")} - {"cpu"}
        monkeypatch.setenv("HAL_DISABLE_PLUGINS", ",".join(sorted(real | set(extra))))
        hal_core.reset()

    return disable


@pytest.fixture
def private_tune_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private, empty tune store (HAL_TUNE_DIR) with tuning on; no loaded table leaks in or out of the test."""
    from hal_core import tuning

    folder = tmp_path / "tune-store"
    monkeypatch.setenv("HAL_TUNE_DIR", str(folder))
    monkeypatch.delenv("HAL_TUNE", raising=False)
    tuning.forget()
    yield folder
    tuning.forget()
