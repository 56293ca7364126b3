"""The pytest plugin of the conformance kit: options, fixtures and the fallback check. Opt-in.

Load it with ``pytest -p hal_core.testing`` (or ``pytest_plugins =
["hal_core.testing"]`` in a top-level ``conftest.py``); nothing loads it
into a pytest session by itself.

Options: ``--hal-backend=NAME`` (default ``cpu``) picks the backend under
test; ``--hal-seed=N`` fixes the seed the ``hal_rng`` fixture derives from
(a fresh one is drawn and printed each run otherwise);
``--hal-allow-fallback`` turns off the fallback check below. Hypothesis
tests draw their own ``seed`` argument, shown in any falsifying example.

The fallback check: every test that uses ``hal_backend`` records what the
backend's front door did. The test fails when a call fell back although
the backend's :class:`~hal_core.ops.OpCoverage` declaration claims its
arguments, and whenever an implementation raised or returned a result of
the wrong shape, dtype or device (a fault).
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import pytest

pytest.register_assert_rewrite("hal_core.testing.suite", "hal_core.testing.inputs")

__all__ = [
    "BackendArrays",
    "hal_arrays",
    "hal_axpy_source",
    "hal_backend",
    "hal_backend_name",
    "hal_device",
    "hal_rng",
    "hal_seed",
    "pytest_addoption",
    "pytest_configure",
    "pytest_report_header",
    "pytest_runtest_call",
]

_SEED_KEY = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hal")
    group.addoption("--hal-backend", action="store", default=None,
                    help="run hal's contract suite against this backend (default: cpu)")
    group.addoption("--hal-seed", action="store", type=int, default=None,
                    help="base seed of the 'hal_rng' fixture (default: fresh each run, printed in the header)")
    group.addoption("--hal-allow-fallback", action="store_true", default=False,
                    help="do not fail tests in which a call the backend declares supported fell back")


def pytest_configure(config: pytest.Config) -> None:
    seed = config.getoption("hal_seed", None)
    config.stash[_SEED_KEY] = int(seed) if seed is not None else secrets.randbits(32)


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash[_SEED_KEY]
    backend = config.getoption("hal_backend", None) or "cpu"
    return f"hal: backend={backend} seed={seed} (reproduce with --hal-seed={seed})"


def _judge(backend: Any, events: list[Any], allow_fallback: bool) -> list[str]:
    """What went wrong in a test's calls: faults, and fallbacks of calls the backend declares it runs."""
    problems = []
    for event in events:
        if event.kind == "fault":
            problems.append(f"{event.op}: implementation fault: {event.reason}")
            continue
        if allow_fallback or event.reason == "HAL_FORCE_CPU is set":
            continue
        spec, args = event.call.spec, event.call.args
        declared = backend.ops.coverage(event.op).covers_call(spec, args)
        if declared is True:
            problems.append(f"{event.op} fell back although backend {backend.name!r} declares these arguments "
                            f"supported ({spec.features_of(args)}): {event.reason}")
    return sorted(set(problems))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """Run the test while recording its backend's fallbacks and faults; fail it on an undeclared one."""
    backend = getattr(item, "funcargs", {}).get("hal_backend")
    if backend is None:
        return (yield)
    with backend.ops.watch() as events:
        result = yield
    problems = _judge(backend, events, item.config.getoption("hal_allow_fallback", False))
    if problems:
        listing = "\n  ".join(problems)
        raise AssertionError(
            f"backend {backend.name!r} did not run these calls itself:\n  {listing}\n"
            f"implement them, declare them unsupported with registry.declare(op, OpCoverage(...)), "
            f"or run with --hal-allow-fallback"
        )
    return result


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
def hal_rng(request: pytest.FixtureRequest, hal_seed: int) -> Iterator[np.random.Generator]:
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

    Picked by the launcher's :attr:`~hal_core.KernelLauncher.source_suffix`
    among the kit's test kernels (``axpy_host.py`` for ``".py"``, ``axpy.cu``
    for ``".cu"``); a backend with another kernel language overrides this
    fixture in its ``conftest.py``.
    """
    from importlib import resources

    from hal_core import KernelSource

    suffix = type(hal_device.launcher).source_suffix
    # the kit's own test kernels, then the ``kernels`` package beside the launcher's distribution
    packages = ["hal_core.testing.kernels", type(hal_device.launcher).__module__.split(".")[0] + ".kernels"]
    for package in packages:
        try:
            files = resources.files(package).iterdir()
        except (ModuleNotFoundError, TypeError):
            continue
        names = sorted(f.name for f in files if f.name.startswith("axpy") and suffix and f.name.endswith(suffix))
        if names:
            return KernelSource.from_package(names[0], ["hal_test_axpy"], package=package)
    pytest.skip(f"no axpy test kernel for source suffix {suffix!r} in {packages}; override hal_axpy_source")
