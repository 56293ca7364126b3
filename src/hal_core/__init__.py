"""hal: a plugin-based hardware abstraction layer for LLM inference kernels.

Engine code asks for a backend and calls its ops::

    import hal_core
    be = hal_core.get_backend()     # best available; CPU when nothing else is
    out = be.ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=0.125)

Importing this package imports no plugin and no vendor SDK; plugins are
discovered on the first :func:`get_backend` or :func:`list_backends`.
:class:`DeviceCapabilities`, :func:`load_profile` and :func:`profile_names`
(pydantic) are imported on first use.
"""

from __future__ import annotations

import contextlib
import typing

from ._backend import Availability, Backend
from ._device import DeviceHandle
from ._discovery import PluginRecord
from ._errors import (
    ArgumentError,
    ArgumentTypeError,
    BackendConflictError,
    BackendNotFoundError,
    BackendUnavailableError,
    CheckpointError,
    ConfigurationError,
    DeviceOutOfMemoryError,
    EnvironmentVariableError,
    FallbackError,
    HalError,
    ImplementationError,
    KernelCompileError,
    LaunchConfigError,
    OutOfBlocksError,
)
from ._hookspecs import hookimpl, hookspec
from ._launch import CompiledKernel, KernelLauncher, KernelSource, LaunchConfig, grid_for
from ._memory import AllocationPolicy, Allocator, AllocatorStats, DeviceBuffer
from ._runtime import reset
from ._selection import BackendInfo, check_errors, get_backend, list_backends, stats
from ._stream import Event, Stream
from ._version import API_VERSION, __version__

if typing.TYPE_CHECKING:
    from ._capabilities import DeviceCapabilities, load_profile, profile_names
    from .ops import AttentionOptions

__all__ = [
    "API_VERSION",
    "AllocationPolicy",
    "Allocator",
    "AllocatorStats",
    "ArgumentError",
    "ArgumentTypeError",
    "AttentionOptions",
    "Availability",
    "Backend",
    "BackendConflictError",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CheckpointError",
    "CompiledKernel",
    "ConfigurationError",
    "DeviceBuffer",
    "DeviceCapabilities",
    "DeviceHandle",
    "DeviceOutOfMemoryError",
    "EnvironmentVariableError",
    "Event",
    "FallbackError",
    "HalError",
    "ImplementationError",
    "KernelCompileError",
    "KernelLauncher",
    "KernelSource",
    "LaunchConfig",
    "LaunchConfigError",
    "OutOfBlocksError",
    "PluginRecord",
    "Stream",
    "__version__",
    "check_errors",
    "get_backend",
    "grid_for",
    "hookimpl",
    "hookspec",
    "list_backends",
    "list_plugins",
    "load_profile",
    "profile_names",
    "reset",
    "stats",
]


def list_plugins() -> list[PluginRecord]:
    """Every entry point of the ``hal`` group: loaded, rejected or disabled, and why."""
    from ._runtime import current

    return list(current().discovery().plugins)


#: Public names whose module is imported on first use: pydantic (capabilities) costs as much as numpy to import,
#: and selecting and running the CPU backend never needs it.
_LAZY = {"DeviceCapabilities": "._capabilities", "load_profile": "._capabilities", "profile_names": "._capabilities",
         "AttentionOptions": ".ops"}


if not typing.TYPE_CHECKING:  # the type checker sees the imports above, and still flags a misspelt name

    def __getattr__(name: str) -> typing.Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        loaded = importlib.import_module(module, __name__)
        for lazy, where in _LAZY.items():
            if where == module:
                globals()[lazy] = value = getattr(loaded, lazy)
                _claim(value)
        return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _claim(value: typing.Any) -> None:
    """A public name reports ``hal_core`` as its module (documented and pickled from here)."""
    if getattr(value, "__module__", "").startswith(("hal_core._", "hal_core.ops", "pluggy")):
        with contextlib.suppress(AttributeError, TypeError):  # a pluggy marker instance keeps its own
            value.__module__ = __name__


def _claim_public_names() -> None:
    for name in __all__:
        if name not in _LAZY:
            _claim(globals()[name])


_claim_public_names()
