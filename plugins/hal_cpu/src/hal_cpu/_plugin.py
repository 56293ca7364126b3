"""The entry point named in the ``hal`` group: declares the API version and the backend."""

from __future__ import annotations

from hal_core import API_VERSION, hookimpl

from ._backend import CpuBackend

__all__ = ["hal_api_version", "hal_backends"]


@hookimpl
def hal_api_version() -> tuple[int, int]:
    """The HAL API version this plugin implements."""
    return API_VERSION


@hookimpl
def hal_backends() -> list[type]:
    """The backend classes this plugin provides."""
    return [CpuBackend]
