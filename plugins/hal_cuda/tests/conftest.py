"""Fixtures of the hal-cuda tests.

GPU tests ask for ``cuda_backend`` (or ``cupy_module``): the skip is decided
there, lazily, with the probe's reason; nothing here touches a device at
import or collection time.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nvidia_profiles

import hal_core


@pytest.fixture(scope="session")
def cuda_probe() -> Any:
    from hal_cuda._probe import probe

    return probe()


@pytest.fixture(scope="session")
def cupy_module(cuda_probe: Any) -> Any:
    """CuPy, when a CUDA device is usable; otherwise the test is skipped with the probe's reason."""
    if not cuda_probe.ok:
        pytest.skip(f"no CUDA device: {cuda_probe.reason}")
    import cupy

    return cupy


@pytest.fixture(scope="session")
def cuda_backend(cupy_module: Any) -> Iterator[Any]:
    """The bound CUDA backend, one for the session (its compiled kernels are reused across tests)."""
    hal_core.reset()
    backend = hal_core.get_backend("cuda")
    yield backend
    cupy_module.cuda.Device(0).synchronize()
    hal_core.reset()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with an explicit seed derived from the test id (reproducible, distinct per test)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
