"""hal: a plugin-based hardware abstraction layer for LLM inference kernels.

Engine code asks for a backend and calls its ops::

    import hal_core
    be = hal_core.get_backend()     # best available; CPU when nothing else is
    out = be.ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=0.125)

Importing this package imports no plugin and no vendor SDK; plugins are
discovered on the first :func:`get_backend` or :func:`list_backends`.
"""

from __future__ import annotations

import contextlib

from ._backend import Availability, Backend
from ._capabilities import DeviceCapabilities, load_profile, profile_names
from ._device import DeviceHandle
from ._discovery import PluginRecord
from ._errors import (
    ArgumentError,
    ArgumentTypeError,
    BackendConflictError,
    BackendNotFoundError,
    BackendUnavailableError,
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

__all__ = [
    "API_VERSION",
    "AllocationPolicy",
    "Allocator",
    "AllocatorStats",
    "ArgumentError",
    "ArgumentTypeError",
    "Availability",
    "Backend",
    "BackendConflictError",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CompiledKernel",
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


def _claim_public_names() -> None:
    """Public names report ``hal_core`` as their module (they are documented and pickled from here)."""
    for name in __all__:
        value = globals()[name]
        if getattr(value, "__module__", "").startswith(("hal_core._", "pluggy")):
            with contextlib.suppress(AttributeError, TypeError):  # a pluggy marker instance keeps its own
                value.__module__ = __name__


_claim_public_names()
