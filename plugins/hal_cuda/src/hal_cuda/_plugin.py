"""The ``hal`` entry point of hal-cuda: declares the API version and the backend class.

Importing this module imports no CuPy and touches no driver.
"""

from __future__ import annotations

from hal_core import API_VERSION, hookimpl

from ._backend import CudaBackend

__all__ = ["hal_api_version", "hal_backends"]


@hookimpl
def hal_api_version() -> tuple[int, int]:
    return API_VERSION


@hookimpl
def hal_backends() -> list[type]:
    return [CudaBackend]
