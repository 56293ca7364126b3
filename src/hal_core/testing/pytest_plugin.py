"""pytest plugin registered by hal-core (``pytest11``): options and fixtures of the contract suite.

Options: ``--hal-backend=NAME`` (default ``cpu``) picks the backend under
test; ``--hal-seed=N`` fixes the seed the ``rng`` fixture derives from (a
fresh one is drawn and printed each run otherwise). Hypothesis tests draw
their own ``seed`` argument, shown in any falsifying example.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.register_assert_rewrite("hal_core.testing.suite", "hal_core.testing.inputs")

_SEED_KEY = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hal")
    group.addoption("--hal-backend", action="store", default=None,
                    help="run hal's contract suite against this backend (default: cpu)")
    group.addoption("--hal-seed", action="store", type=int, default=None,
                    help="base seed of the 'rng' fixture (default: fresh each run, printed in the header)")


def pytest_configure(config: pytest.Config) -> None:
    seed = config.getoption("hal_seed", None)
    config.stash[_SEED_KEY] = int(seed) if seed is not None else secrets.randbits(32)


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash[_SEED_KEY]
    backend = config.getoption("hal_backend", None) or "cpu"
    return f"hal: backend={backend} seed={seed} (reproduce with --hal-seed={seed})"


@pytest.fixture(scope="session")
def hal_backend_name(pytestconfig: pytest.Config) -> str:
    """The name given with ``--hal-backend`` (``cpu`` by default)."""
    return pytestconfig.getoption("hal_backend", None) or "cpu"


@pytest.fixture(scope="session")
def hal_backend(hal_backend_name: str) -> Any:
    """The backend under test; the test is skipped, with the reason, when it cannot run here."""
    import hal_core

    try:
        return hal_core.get_backend(hal_backend_name)
    except (hal_core.BackendNotFoundError, hal_core.BackendUnavailableError) as exc:
        pytest.skip(f"backend {hal_backend_name!r} is not usable here: {exc}")


@pytest.fixture(scope="session")
def hal_device(hal_backend: Any) -> Any:
    """Device 0 of the backend under test."""
    return hal_backend.device(0)


@pytest.fixture(scope="session")
def hal_seed(pytestconfig: pytest.Config) -> int:
    """The run's base seed (``--hal-seed`` or fresh)."""
    return pytestconfig.stash[_SEED_KEY]


@pytest.fixture
def rng(request: pytest.FixtureRequest, hal_seed: int) -> Iterator[np.random.Generator]:
    """A generator seeded from the run's seed and the test's id; the seed is printed for failures."""
    test_seed = zlib.crc32(request.node.nodeid.encode())
    print(f"hal seed: --hal-seed={hal_seed} (test stream {test_seed})")
    yield np.random.default_rng([hal_seed, test_seed])


class BackendArrays:
    """Create and read arrays in a backend's memory domain (``backend.asarray`` / ``to_numpy``)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def asarray(self, array: Any) -> Any:
        return self.backend.asarray(np.asarray(array))

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(self.backend.to_numpy(array))

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.asarray(np.zeros(shape, dtype=dtype))

    def full(self, shape: tuple[int, ...], value: float, dtype: Any) -> Any:
        return self.asarray(np.full(shape, value, dtype=dtype))

    def randn(self, rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.asarray(rng.standard_normal(shape).astype(dtype))


@pytest.fixture(scope="session")
def hal_arrays(hal_backend: Any) -> BackendArrays:
    """Array helpers bound to the backend under test."""
    return BackendArrays(hal_backend)


@pytest.fixture(scope="session")
def hal_axpy_source(hal_device: Any) -> Any:
    """The ``hal_test_axpy(x, y, a, n)`` kernel in the launcher's language.

    Host (Python) source for a CPU device, CUDA C otherwise; a backend with
    another kernel language overrides this fixture in its ``conftest.py``.
    """
    from hal_core import KernelSource

    if hal_device.capabilities.vendor == "cpu":
        return KernelSource.from_package("axpy_host.py", ["hal_test_axpy"], package="hal_core.testing.kernels")
    return KernelSource.from_package("axpy.cu", ["hal_test_axpy"], package="hal_cupy.kernels")
