"""The public face of hal_core: ``__all__`` lists exactly the public names."""

from __future__ import annotations
import __future__

import types

import hal_core


def test_all_equals_public_names() -> None:
    """Every public attribute of hal_core is in __all__ and every name in __all__ exists (httpx's test).

    ``dir()`` lists the names imported on first use too; ``getattr`` imports them.
    """
    public = {
        name for name in dir(hal_core)
        if not name.startswith("_") and not isinstance(getattr(hal_core, name), (types.ModuleType, __future__._Feature))
    }
    assert set(hal_core.__all__) == public | {"__version__"}
    assert len(hal_core.__all__) == len(set(hal_core.__all__))


def test_public_names_come_from_hal_core() -> None:
    """Public classes and functions report hal_core itself as their home, never a private module."""
    for name in hal_core.__all__:
        value = getattr(hal_core, name)
        if not (isinstance(value, type) or callable(value)):
            continue
        module = getattr(value, "__module__", "hal_core") or "hal_core"
        assert module == "hal_core" or module.startswith("pluggy"), (name, module)


def test_version_is_a_string_and_api_version_a_pair() -> None:
    """__version__ is a version string and API_VERSION a (major, minor) tuple of ints."""
    assert isinstance(hal_core.__version__, str) and hal_core.__version__.count(".") >= 1
    major, minor = hal_core.API_VERSION
    assert isinstance(major, int) and isinstance(minor, int)


def test_capabilities_are_imported_on_first_use() -> None:
    """``import hal_core`` leaves pydantic unimported; the first use of a capabilities name imports it."""
    import subprocess
    import sys

    code = ("import sys, hal_core; assert 'pydantic' not in sys.modules, 'pydantic imported'; "
            "assert 'DeviceCapabilities' in dir(hal_core); "
            "caps = hal_core.load_profile('h200'); assert 'pydantic' in sys.modules; "
            "assert type(caps) is hal_core.DeviceCapabilities; "
            "assert hal_core.DeviceCapabilities.__module__ == 'hal_core'; "
            "from hal_core import profile_names; assert 'NVIDIA H200' in profile_names()")
    subprocess.run([sys.executable, "-c", code], check=True)
