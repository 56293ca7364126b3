"""Fixtures of the hal-cupy tests: seeded generators, the fake CuPy and the host compiler of the kernel sources.

Nothing here touches a device, imports CuPy, or needs a vendor plugin.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fakecupy, kernel_emulator, gpu_profiles, host_compiled

from hal_cupy.testing import missing_compiler
from host_compiled.harness import HostKernelBuilder, toolchain_problem


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with an explicit seed derived from the test id (reproducible, distinct per test)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Replace the lazily imported CuPy with :class:`fakecupy.FakeCupy` in every hal-cupy module."""
    import fakecupy
    from hal_cupy import _cupy, _index_errors, _launcher, _memory, _stream

    fake = fakecupy.FakeCupy()
    for module in (_cupy, _index_errors, _launcher, _memory, _stream):
        monkeypatch.setattr(module, "cupy", lambda: fake)
    _index_errors.forget_flags()
    yield fake
    _index_errors.forget_flags()


@pytest.fixture(scope="session")
def host_builder(tmp_path_factory: pytest.TempPathFactory) -> HostKernelBuilder:
    """Compiler for the kernel sources of ``hal_cupy.kernels``; skips when g++ cannot build the host prelude."""
    problem = toolchain_problem(tmp_path_factory.mktemp("host_compiled_probe"))
    if problem is not None:
        missing_compiler(f"host-compiled kernels unavailable: {problem}")
    return HostKernelBuilder(tmp_path_factory.mktemp("host_compiled_kernels"))


@pytest.fixture
def host_rng(request: pytest.FixtureRequest, hal_seed: int) -> np.random.Generator:
    """Fresh inputs each run: seeded from the run's ``--hal-seed`` and the test id, printed for failures."""
    test_seed = zlib.crc32(request.node.nodeid.encode())
    print(f"hal seed: --hal-seed={hal_seed} (test stream {test_seed})")
    return np.random.default_rng([hal_seed, test_seed])
