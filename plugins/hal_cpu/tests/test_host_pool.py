"""Parallel jobs on the OpenMP runtime the process loaded (the host pool), and the switch that keeps them off it.

With torch imported (its wheel bundles libgomp) the kernels' parallel jobs run
on that runtime's team: the results must be the bits of the own pool and of one
thread, the counters must say which pool ran, ``HAL_CPU_HOST_POOL=0`` must keep
the own pool, a process without an OpenMP runtime must never use it, a job
inside an OpenMP region must run on its caller, and a forked child must make
its own pool.
"""

from __future__ import annotations

import ast
import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import hal_cpu
import numpy as np
import pytest
from hal_cpu import _abi, _native, _pool
from hal_cpu.ops import paged_attention, quantized_gemm
from hal_cpu.ops._native_args import dtype_code

from hal_core.ops import OPS
from hal_core.ops.quantized_gemm import quantized_gemm_inputs
from hal_core.testing.inputs import assert_close, paged_attention_inputs

torch = pytest.importorskip("torch", reason="torch brings the OpenMP runtime (libgomp) these tests run on")

#: Longer than the pool's longest back-off (csrc/dispatch.cpp, kMaxBackoffUs): the next job runs on a pool.
PAST_BACKOFF_S = 0.07


@pytest.fixture
def host_pool(native: _native.Native) -> Iterator[Callable[[bool], None]]:
    """``host_pool(False)`` keeps jobs on the own pool until the test ends (then the default again)."""
    previous = native.lib.hal_cpu_set_host_pool(1)
    yield lambda on: native.lib.hal_cpu_set_host_pool(int(on))
    native.lib.hal_cpu_set_host_pool(previous)


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {name: value - before[name] for name, value in hal_cpu.pool_stats().items()}


def _check_host_run(counts: dict[str, int]) -> None:
    """The op's jobs ran on the host pool, but for those sent to the own pool by a starved one (a loaded machine)."""
    assert counts["host_pool_jobs"] > 0, counts
    assert counts["own_pool_jobs"] == 0 or counts["starved_jobs"] > 0, counts


def _run_counted(fn: Callable[[], np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    time.sleep(PAST_BACKOFF_S)  # a starved job earlier (a loaded machine) may not keep this one serial
    before = hal_cpu.pool_stats()
    return fn(), _delta(before)


def test_the_loaded_runtime_is_found(native: _native.Native, host_pool: Callable[[bool], None]) -> None:
    """torch's OpenMP runtime is the host runtime; with the switch off there is none."""
    path = hal_cpu.host_runtime()
    assert path is not None and os.path.basename(path).startswith(("libgomp", "libiomp5", "libomp"))
    with open("/proc/self/maps") as maps:
        assert path in maps.read()
    host_pool(False)
    assert hal_cpu.host_runtime() is None


def test_w4a16_bits_match_on_every_pool(rng: np.random.Generator, host_pool: Callable[[bool], None]) -> None:
    """W4A16 at M=1 and M=5: host pool, own pool and one thread give the same bits, within the float64 bound."""
    for m in (1, 5):
        args = quantized_gemm_inputs(rng, m=m, k=1024, n=1027, bits=4, group_size=128, symmetric=False, dtype="fp32")

        def run(threads: int, a: dict = args) -> np.ndarray:
            return quantized_gemm.gemm(a["x"], a["qweight"], threads=threads)

        host_pool(True)
        on_host, host_counts = _run_counted(lambda: run(2))
        host_pool(False)
        on_own, own_counts = _run_counted(lambda: run(2))
        one, one_counts = _run_counted(lambda: run(1))
        _check_host_run(host_counts)
        assert own_counts["own_pool_jobs"] > 0 and own_counts["host_pool_jobs"] == 0, own_counts
        assert one_counts["own_pool_jobs"] == one_counts["host_pool_jobs"] == 0, one_counts
        assert np.array_equal(on_host, on_own) and np.array_equal(on_host, one), f"M={m}"
        assert_close(on_host, OPS["quantized_gemm"].reference(args), kind="gemm", dtype="fp32", what=f"M={m}")


def test_attention_bits_match_on_every_pool(rng: np.random.Generator, host_pool: Callable[[bool], None]) -> None:
    """Decode and prompt attention (split over KV): host pool, own pool and one thread give the same bits."""
    args = paged_attention_inputs(rng, seq_lens=[700, 1, 260, 33], num_heads=8, num_kv_heads=2, head_size=64,
                                  block_size=16, dtype="fp16")

    def run(threads: int) -> np.ndarray:
        return paged_attention.attend(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                      args["seq_lens"], args["scale"], partition_tokens=128, threads=threads)

    host_pool(True)
    on_host, host_counts = _run_counted(lambda: run(2))
    host_pool(False)
    on_own, own_counts = _run_counted(lambda: run(2))
    one = run(1)
    _check_host_run(host_counts)
    assert own_counts["own_pool_jobs"] > 0 and own_counts["host_pool_jobs"] == 0, own_counts
    assert np.array_equal(on_host, on_own) and np.array_equal(on_host, one)
    assert_close(on_host, OPS["paged_attention"].reference(args), kind="attention", dtype="fp16", what="host pool")


def _convert(native: _native.Native, x: np.ndarray, threads: int) -> np.ndarray:
    out = np.full(x.shape, np.nan, dtype=np.float32)
    args = _abi.ToFloat32Args(x=_native.pointer(x), x_stride=x.shape[1], m=x.shape[0], k=x.shape[1],
                              out=_native.pointer(out), dtype=dtype_code(x), threads=threads)
    assert native.lib.hal_cpu_to_float32(ctypes.byref(args)) == 0
    return out


def test_a_job_inside_an_openmp_region_runs_on_its_caller(native: _native.Native, rng: np.random.Generator) -> None:
    """Called from inside a parallel region of the host runtime, a job is not nested: it runs serially, exact."""
    path = hal_cpu.host_runtime()
    assert path is not None
    omp = ctypes.CDLL(path)  # already loaded: the same library
    omp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    omp.GOMP_parallel.restype = None
    x = rng.standard_normal((64, 300)).astype(np.float16)
    results: list[np.ndarray] = []

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def region(_: int | None) -> None:
        if omp.omp_get_thread_num() == 0:
            results.append(_convert(native, x, 2))

    time.sleep(PAST_BACKOFF_S)
    before = hal_cpu.pool_stats()
    omp.GOMP_parallel(ctypes.cast(region, ctypes.c_void_p), None, 2, 0)
    counts = _delta(before)
    assert len(results) == 1
    np.testing.assert_array_equal(results[0], x.astype(np.float32))
    assert counts["nested_jobs"] == 1 and counts["host_pool_jobs"] == counts["own_pool_jobs"] == 0, counts


def test_a_starved_host_job_sends_the_next_jobs_to_the_own_pool(
        native: _native.Native, host_pool: Callable[[bool], None], rng: np.random.Generator) -> None:
    """After starved host-pool jobs the next job runs on the own pool (whose workers are never waited for), and
    the first job after the longest back-off time on the host pool again; the bits never change."""
    x = rng.standard_normal((8, 4096)).astype(np.float16)
    time.sleep(PAST_BACKOFF_S)
    for _ in range(6):
        native.lib.hal_cpu_pool_note_starved(1)  # 2, 4, ..., 64 ms: doubling up to the longest
    before = hal_cpu.pool_stats()
    np.testing.assert_array_equal(_convert(native, x, 2), x.astype(np.float32))
    counts = _delta(before)
    assert counts["own_pool_jobs"] == 1 and counts["host_pool_jobs"] == 0, counts
    time.sleep(PAST_BACKOFF_S)
    before = hal_cpu.pool_stats()
    np.testing.assert_array_equal(_convert(native, x, 2), x.astype(np.float32))
    counts = _delta(before)
    assert counts["host_pool_jobs"] == 1 and counts["own_pool_jobs"] == 0, counts


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in (_pool.HOST_POOL_ENV, "HAL_CPU_THREADS")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**clean, **env}, check=False)


_PRELUDE = """
import os, time, numpy as np, hal_cpu
from hal_cpu.ops import quantized_gemm
from hal_core.quant import quantize
w = quantize(np.random.default_rng(0).standard_normal((1024, 2048)).astype(np.float32), bits=4, group_size=128)
x = np.random.default_rng(1).standard_normal((1, 1024)).astype(np.float32)
def run():
    time.sleep(0.07)
    return quantized_gemm.gemm(x, w, threads=2)
"""


def test_jobs_move_at_the_first_job_after_the_runtime_loads() -> None:
    """Before ``import torch`` the own pool runs the jobs (no OpenMP runtime loaded), after it the host pool."""
    code = _PRELUDE + """
first = run()
print(hal_cpu.host_runtime(), any('omp' in os.path.basename(l.split()[-1]) for l in open('/proc/self/maps')
                                  if len(l.split()) > 5))
print(hal_cpu.pool_stats())
import torch
second = run()
print(os.path.basename(hal_cpu.host_runtime()), np.array_equal(first, second))
print(hal_cpu.pool_stats())
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "None False", "an OpenMP runtime was loaded or used without torch"
    before, after = ast.literal_eval(lines[1]), ast.literal_eval(lines[3])
    assert before["own_pool_jobs"] > 0 and before["host_pool_jobs"] == 0, before
    assert lines[2].startswith(("libgomp", "libiomp5", "libomp")) and lines[2].endswith("True"), lines[2]
    _check_host_run({name: after[name] - before[name] for name in after})


def test_the_switch_keeps_the_own_pool() -> None:
    """``HAL_CPU_HOST_POOL=0``: with torch loaded, every job still runs on hal-cpu's own pool."""
    result = _python("import torch\n" + _PRELUDE + "run(); print(hal_cpu.host_runtime(), hal_cpu.pool_stats())",
                     HAL_CPU_HOST_POOL="0")
    assert result.returncode == 0, result.stderr
    runtime, stats = result.stdout.strip().split(" ", 1)
    counts = ast.literal_eval(stats)
    assert runtime == "None" and counts["own_pool_jobs"] > 0 and counts["host_pool_jobs"] == 0, result.stdout


@pytest.mark.parametrize("value", ["maybe", "2", "-1"])
def test_a_bad_switch_value_names_the_variable(value: str) -> None:
    """A value that is neither an on nor an off spelling raises at the first op, naming HAL_CPU_HOST_POOL."""
    result = _python(_PRELUDE + "run()", HAL_CPU_HOST_POOL=value)
    assert result.returncode != 0
    assert "EnvironmentVariableError" in result.stderr and _pool.HOST_POOL_ENV in result.stderr, result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_pool() -> None:
    """A child forked after jobs ran on the host runtime leaves that runtime alone: own pool, same bits."""
    code = "import torch\n" + _PRELUDE + """
parent = run()
assert hal_cpu.host_runtime() is not None and hal_cpu.pool_stats()["host_pool_jobs"] > 0
pid = os.fork()
if pid == 0:
    before = hal_cpu.pool_stats()
    child = run()
    after = hal_cpu.pool_stats()
    ok = (hal_cpu.host_runtime() is None and np.array_equal(child, parent)
          and after["own_pool_jobs"] > before["own_pool_jobs"] and after["host_pool_jobs"] == before["host_pool_jobs"])
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), np.array_equal(run(), parent))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"], result.stdout
