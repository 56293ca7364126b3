"""The library's thread pool: its poll-before-blocking setting, and results that never depend on how it ran.

Workers poll for the next job for ``HAL_CPU_SPIN_US`` microseconds before they
block, join a job only while the caller is still taking tasks, and a call made
while another is using the pool runs on its own thread. Each way of running a
job must give the serial result: these tests run the same conversion serially
and in parallel, back to back, after pauses (blocked workers), with polling off
and on, and from several Python threads at once. A worker that loses its core
makes the next jobs run serially, for a bounded time only.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hal_cpu import _abi, _native
from hal_cpu._pool import pool_stats as _stats
from hal_cpu.ops._native_args import dtype_code


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=False)


_SHOW_SPIN = "from hal_cpu import _native; print(_native.load().lib.hal_cpu_set_spin_us(0))"


def test_spin_defaults_and_follows_the_environment() -> None:
    """The library loads with HAL_CPU_SPIN_US when set, else the documented default."""
    env = {k: v for k, v in os.environ.items() if k != _native.SPIN_ENV}
    default = subprocess.run([sys.executable, "-c", _SHOW_SPIN], capture_output=True, text=True, timeout=120,
                             env=env, check=True)
    assert default.stdout.strip() == str(_native.DEFAULT_SPIN_US)
    assert _python(_SHOW_SPIN, HAL_CPU_SPIN_US="0").stdout.strip() == "0"
    assert _python(_SHOW_SPIN, HAL_CPU_SPIN_US="250").stdout.strip() == "250"


@pytest.mark.parametrize("value", ["-1", "soon", "1.5", "2000000"])
def test_a_bad_spin_setting_is_an_error_naming_it(value: str) -> None:
    """A value that is not a count of microseconds in range raises at the first load, naming the variable."""
    result = _python(_SHOW_SPIN, HAL_CPU_SPIN_US=value)
    assert result.returncode != 0
    assert "EnvironmentVariableError" in result.stderr and "HAL_CPU_SPIN_US" in result.stderr, result.stderr


@pytest.fixture(params=[0, 100, 20_000], ids=lambda us: f"spin{us}us")
def spin(request: pytest.FixtureRequest, native: _native.Native) -> Iterator[int]:
    """Each test body runs with workers blocking at once, polling 100 us, and polling 20 ms."""
    previous = native.lib.hal_cpu_set_spin_us(request.param)
    try:
        yield request.param
    finally:
        native.lib.hal_cpu_set_spin_us(previous)


def _convert(native: _native.Native, x: np.ndarray, threads: int) -> np.ndarray:
    out = np.full(x.shape, np.nan, dtype=np.float32)
    args = _abi.ToFloat32Args(x=_native.pointer(x), x_stride=x.shape[1], m=x.shape[0], k=x.shape[1],
                              out=_native.pointer(out), dtype=dtype_code(x), threads=threads)
    rc = native.lib.hal_cpu_to_float32(ctypes.byref(args))
    assert rc == 0
    return out


def test_parallel_calls_match_serial_ones(native: _native.Native, spin: int, rng: np.random.Generator) -> None:
    """Back-to-back calls, calls after a pause (workers blocked) and more tasks than threads: each row exact."""
    for call in range(300):
        rows = int(rng.integers(2, 40))
        x = rng.standard_normal((rows, int(rng.integers(1, 300)))).astype(np.float16)
        want = x.astype(np.float32)
        if call % 50 == 0:
            time.sleep(0.03)  # past every poll: the workers block and must be woken
        threads = int(rng.integers(2, 2 * max(2, native.threads) + 1))
        np.testing.assert_array_equal(_convert(native, x, threads), want, err_msg=f"call {call}, {threads} threads")
        np.testing.assert_array_equal(_convert(native, x, 1), want)


def test_concurrent_callers_match_serial_results(native: _native.Native, spin: int,
                                                 rng: np.random.Generator) -> None:
    """Several Python threads calling at once (one holds the pool, the others run inline): every result exact."""
    inputs = [rng.standard_normal((int(rng.integers(2, 64)), 257)).astype(np.float16) for _ in range(24)]
    wants = [x.astype(np.float32) for x in inputs]
    failures: list[str] = []

    def caller(index: int) -> None:
        for rep in range(40):
            i = (index * 7 + rep) % len(inputs)
            if not np.array_equal(_convert(native, inputs[i], 2 * max(2, native.threads)), wants[i]):
                failures.append(f"caller {index}, input {i}")

    callers = [threading.Thread(target=caller, args=(index,)) for index in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in callers), "a caller never returned"
    assert not failures, failures[:5]



def test_the_back_off_runs_jobs_serially_and_ends_within_its_longest_time(native: _native.Native,
                                                                          rng: np.random.Generator) -> None:
    """After starved jobs the next job runs on the caller alone; the first job after the longest back-off time
    (64 ms, reached after six starved jobs in a row) runs on a pool again. Results stay exact throughout."""
    x = rng.standard_normal((8, 4096)).astype(np.float16)
    for _ in range(6):
        native.lib.hal_cpu_pool_note_starved(0)  # an own-pool job: 2, 4, ..., 64 ms, doubling up to the longest
    before = _stats()
    np.testing.assert_array_equal(_convert(native, x, 2), x.astype(np.float32))
    during = _stats()
    assert during["serial_jobs"] == before["serial_jobs"] + 1, (before, during)
    assert during["own_pool_jobs"] + during["host_pool_jobs"] == before["own_pool_jobs"] + before["host_pool_jobs"]
    time.sleep(0.07)
    np.testing.assert_array_equal(_convert(native, x, 2), x.astype(np.float32))
    after = _stats()
    assert after["serial_jobs"] == during["serial_jobs"], "the back-off outlived its longest time"
    assert after["own_pool_jobs"] + after["host_pool_jobs"] == during["own_pool_jobs"] + during["host_pool_jobs"] + 1
