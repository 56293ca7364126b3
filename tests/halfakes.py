"""Helpers of hal-core's tests: minimal complete contracts for throwaway plugins, and subprocess env.

Throwaway plugin modules written by the ``make_plugin`` fixture import this
module (a copy sits beside them); it depends on nothing but hal-core.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hal_core import Availability, Backend, DeviceCapabilities, DeviceHandle

__all__ = ["FAKE_CAPS", "HAL_VARS", "FakeDevice", "HostBackend", "subprocess_env", "touch"]

#: The HAL_* variables of hal-core.
HAL_VARS = ("HAL_BACKEND", "HAL_FORCE_CPU", "HAL_STRICT", "HAL_DISABLE_PLUGINS", "HAL_CHECK_INDICES",
            "HAL_ALLOW_OVERRIDE", "HAL_PROBE_TIMEOUT_S")

FAKE_CAPS = DeviceCapabilities(
    vendor="test", name="fake device", arch="fake", compute_units=2, simd_width=8,
    max_threads_per_block=1024, max_threads_per_cu=2048, max_block_dims=(1024, 1024, 64),
    max_grid_dims=(2**31 - 1, 65535, 65535), shared_mem_per_block=49152, shared_mem_per_block_optin=0,
    shared_mem_per_cu=65536, registers_per_block=65536, registers_per_cu=65536, l2_bytes=0,
    memory_total=2**30, dtypes=frozenset({"fp32", "fp16", "bf16"}),
)


def touch(path: str, text: str = "x") -> None:
    """Append ``text`` to ``path``: a side effect tests can observe (and count)."""
    with Path(path).open("a") as handle:
        handle.write(text)


class FakeDevice(DeviceHandle):
    """A device with capabilities only; streams, memory and launcher are not offered."""

    def __init__(self, index: int = 0) -> None:
        self._index = index

    @property
    def index(self) -> int:
        return self._index

    @property
    def capabilities(self) -> DeviceCapabilities:
        return FAKE_CAPS

    @property
    def default_stream(self) -> Any:
        raise NotImplementedError("fake devices have no streams")

    def create_stream(self) -> Any:
        raise NotImplementedError("fake devices have no streams")

    def create_event(self, *, timing: bool = True) -> Any:
        raise NotImplementedError("fake devices have no events")

    def synchronize(self) -> None:
        return None

    @property
    def allocator(self) -> Any:
        raise NotImplementedError("fake devices have no allocator")

    @property
    def launcher(self) -> Any:
        raise NotImplementedError("fake devices have no launcher")


class HostBackend(Backend):
    """A complete backend on host numpy memory with no op implementations of its own."""

    name = "host-fake"
    priority = 1
    is_host = True

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    def devices(self) -> Sequence[DeviceHandle]:
        return [FakeDevice(0)]

    def register_ops(self, registry: Any) -> None:
        return None

    def owns(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def asarray(self, array: Any, device: int | None = None) -> Any:
        return np.asarray(array)


def subprocess_env(*paths: Path) -> dict[str, str]:
    """The environment for a child Python: no HAL_* variable, ``paths`` first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in HAL_VARS}
    extra = [str(p) for p in paths]
    if env.get("PYTHONPATH"):
        extra.append(env["PYTHONPATH"])
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(extra)
    return env
