"""The entry point named in the ``hal`` group: declares the API version and the backend."""

from __future__ import annotations

from hal_core import hookimpl

from ._backend import CpuBackend

__all__ = ["HAL_API_VERSION", "hal_api_version", "hal_backends"]

#: The HAL API version this plugin was written against (a literal: hal-core checks it).
HAL_API_VERSION = (1, 0)


@hookimpl
def hal_api_version() -> tuple[int, int]:
    """The HAL API version this plugin implements."""
    return HAL_API_VERSION


@hookimpl
def hal_backends() -> list[type]:
    """The backend classes this plugin provides."""
    return [CpuBackend]
