"""The ``hal`` entry point of hal-rocm: declares the API version and the backend class.

Importing this module imports no CuPy and loads no HIP library.
"""

from __future__ import annotations

from hal_core import hookimpl

from ._backend import RocmBackend

__all__ = ["HAL_API_VERSION", "hal_api_version", "hal_backends"]

#: The HAL API version this plugin was written against (a literal: hal-core checks it).
HAL_API_VERSION = (1, 0)


@hookimpl
def hal_api_version() -> tuple[int, int]:
    return HAL_API_VERSION


@hookimpl
def hal_backends() -> list[type]:
    return [RocmBackend]
