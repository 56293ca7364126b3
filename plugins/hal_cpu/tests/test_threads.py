"""The kernels' thread count: ``HAL_CPU_THREADS``, ``hal_cpu.set_threads``, and kernels that honour it.

A count of 1 must keep every op on the calling thread (the pool is never even
made), a larger count must give the same results, and bad settings are refused
with a message naming them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import hal_cpu
import numpy as np
import pytest
from hal_cpu import _threads
from hal_cpu.ops import _knobs

from hal_core.env import EnvironmentVariableError
from hal_core.quant import quantize


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    yield
    hal_cpu.set_threads(None)


def test_default_is_every_core_and_set_threads_returns_the_previous_count() -> None:
    env_value = os.environ.get(_threads.THREADS_ENV)
    default = _threads.current()
    assert default == (min(int(env_value), _threads.available()) if env_value else _threads.available())
    assert hal_cpu.set_threads(1) == default
    assert _threads.current() == 1 and _knobs.host_threads() == 1
    assert hal_cpu.set_threads(None) == 1
    assert _threads.current() == default


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_bad_counts_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="set_threads"):
        hal_cpu.set_threads(bad)  # type: ignore[arg-type]


def test_more_threads_than_cores_is_clamped() -> None:
    cores = _threads.available()
    hal_cpu.set_threads(cores + 7)
    assert _threads.current() == cores


def test_results_do_not_depend_on_the_thread_count() -> None:
    """The same GEMM and attention bits with one thread and with every core (the rules fix K parts by shape)."""
    seed = int(np.random.SeedSequence().entropy % (2**32))  # type: ignore[operator]
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    import hal_core

    be = hal_core.get_backend("cpu")
    weight = quantize(rng.standard_normal((1024, 2048)).astype(np.float32), bits=4, group_size=128)
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    hal_cpu.set_threads(1)
    before = hal_cpu.pool_stats()
    one = be.ops.quantized_gemm(x, weight)
    assert hal_cpu.pool_stats() == before, "a one-thread op went through the pool"
    hal_cpu.set_threads(None)
    every = be.ops.quantized_gemm(x, weight)
    np.testing.assert_array_equal(one, every)


_COUNT_THREADS = """
import os, numpy as np, hal_core
from hal_core.quant import quantize
be = hal_core.get_backend("cpu")
w = quantize(np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32), bits=4, group_size=128)
x = np.ones((1, 4096), np.float32)
before = len(os.listdir("/proc/self/task"))
for _ in range(3):
    be.ops.quantized_gemm(x, w)
print(before, len(os.listdir("/proc/self/task")))
"""


_FIRST_OP = """
import numpy as np
from hal_core.quant import quantize
from hal_cpu.ops import quantized_gemm
w = quantize(np.ones((256, 256), np.float32), bits=4, group_size=128)
quantized_gemm.gemm(np.ones((1, 256), np.float32), w)
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != _threads.THREADS_ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, **env}, check=False)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count the process's threads")
def test_one_thread_from_the_environment_never_starts_the_pool() -> None:
    one = _run(_COUNT_THREADS, HAL_CPU_THREADS="1")
    assert one.returncode == 0, one.stderr
    before, after = map(int, one.stdout.split())
    assert after == before, "HAL_CPU_THREADS=1 still started pool workers"
    if _threads.available() > 1:
        every = _run(_COUNT_THREADS)
        assert every.returncode == 0, every.stderr
        before, after = map(int, every.stdout.split())
        assert after == before + _threads.available() - 1, "every core should add one pool worker per extra core"


@pytest.mark.parametrize("value", ["two", "abc", "-1", "0", "1.5", "nan", "0x2", "1,2", "inf"])
def test_a_bad_environment_value_names_the_variable(value: str) -> None:
    """Anything but an integer from 1 raises EnvironmentVariableError naming HAL_CPU_THREADS at the first op
    (the plugin's own op entry; the dispatcher's handling of configuration errors is tested with hal-core)."""
    bad = _run(_FIRST_OP, HAL_CPU_THREADS=value)
    assert bad.returncode != 0 and "HAL_CPU_THREADS" in bad.stderr, bad.stderr
    assert EnvironmentVariableError.__name__ in bad.stderr


def test_a_bad_environment_value_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """current() raises on every call while the value is bad, and reads the fixed value afterwards."""
    monkeypatch.setattr(_threads, "_chosen", None)
    monkeypatch.setenv(_threads.THREADS_ENV, "-1")
    for _ in range(2):
        with pytest.raises(EnvironmentVariableError, match=_threads.THREADS_ENV):
            _threads.current()
    monkeypatch.setenv(_threads.THREADS_ENV, "1")
    assert _threads.current() == 1


def test_empty_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty or blank HAL_CPU_THREADS is the default, every core."""
    for value in ("", "  "):
        monkeypatch.setattr(_threads, "_chosen", None)
        monkeypatch.setenv(_threads.THREADS_ENV, value)
        assert _threads.current() == _threads.available()


_CLAMP = """
import hal_cpu
from hal_cpu import _threads
print(_threads.current(), _threads.current())
hal_cpu.set_threads(_threads.available() + 9)
print(_threads.current())
"""


def test_a_count_above_the_cores_is_clamped_with_one_warning() -> None:
    """HAL_CPU_THREADS above the cores gives the cores, with one warning for the process (set_threads too)."""
    cores = _threads.available()
    result = _run(_CLAMP, HAL_CPU_THREADS=str(cores + 5))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(cores)] * 3
    assert result.stderr.count("asks for") == 1 and f"{cores + 5} threads" in result.stderr, result.stderr
