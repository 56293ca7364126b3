"""The machine's limits, measured in the same run as the ops: copy bandwidth and the BLAS rate.

On host memory (numpy arrays): a copy of a buffer far larger than the
last-level cache, split over one thread per core (numpy releases the GIL in
large copies), and a float32 numpy matmul (the BLAS numpy links). On a
device backend the same two measurements run through the array library of
the backend's arrays (a device-to-device copy; its matmul, e.g. cuBLAS),
found from ``backend.asarray`` so hal-core names no vendor.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ._timing import TimingPolicy, measure

__all__ = ["array_module", "last_level_cache_bytes", "measure_blas", "measure_copy"]


def array_module(backend: Any) -> Any:
    """The module of the backend's arrays (``numpy`` for host backends, e.g. ``cupy`` for GPUs)."""
    probe = backend.asarray(np.zeros(1, dtype=np.float32))
    if isinstance(probe, np.ndarray):
        return np
    return sys.modules[type(probe).__module__.split(".")[0]]


def last_level_cache_bytes(capabilities: Any = None) -> int:
    """The largest cache of the device: the device's ``l2_bytes`` when set, else the host's, else 32 MiB."""
    if capabilities is not None and getattr(capabilities, "vendor", "cpu") != "cpu" and capabilities.l2_bytes:
        return int(capabilities.l2_bytes)
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry, "size")) as handle:
                    text = handle.read().strip().upper()
            except OSError:
                continue
            scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            digits = text.rstrip("KMG")
            if digits.isdigit():
                best = max(best, int(digits) * scale)
    except OSError:
        pass
    if not best and capabilities is not None and capabilities.l2_bytes:
        best = int(capabilities.l2_bytes)
    return best or 32 * 1024**2


def _host_copier(src: np.ndarray, dst: np.ndarray, threads: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    pool = ThreadPoolExecutor(max_workers=threads)
    bounds = np.linspace(0, src.size, threads + 1).astype(int)
    pieces = [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(bounds)]

    def copy(_: int) -> None:
        list(pool.map(lambda piece: np.copyto(*piece), pieces))

    return copy, lambda: pool.shutdown(wait=True)


def measure_copy(backend: Any, nbytes: int, policy: TimingPolicy, sync: Callable[[], None]) -> dict[str, Any]:
    """Copy bandwidth, GB/s, counting bytes read plus bytes written: ``2 * nbytes / t``."""
    xp = array_module(backend)
    n = nbytes // 4
    if xp is np:
        threads = os.cpu_count() or 1
        src = np.ones(n, dtype=np.float32)
        dst = np.empty_like(src)
        copy, close = _host_copier(src, dst, threads)
        method = f"numpy copyto in {threads} threads"
    else:
        src = xp.ones(n, dtype=xp.float32)
        dst = xp.empty_like(src)

        def copy(_: int) -> None:
            xp.copyto(dst, src)

        def close() -> None:  # nothing to release on a device
            return None

        method = f"{xp.__name__}.copyto on the device"
    try:
        samples = measure(copy, policy, sync=sync)
    finally:
        close()
    return {"method": method, "bytes": 4 * n, **samples.as_dict(), "gbps": 2 * 4 * n / samples.median / 1e9}


def measure_blas(backend: Any, n: int, policy: TimingPolicy, sync: Callable[[], None],
                 dtype: str = "fp32") -> dict[str, Any]:
    """The rate of an ``n x n x n`` matmul in ``dtype`` through the backend's array library, GFLOP/s."""
    xp = array_module(backend)
    np_dtype = {"fp32": np.float32, "fp16": np.float16}[dtype]
    a = xp.asarray(np.random.default_rng(0).random((n, n), dtype=np.float32).astype(np_dtype))
    b = xp.asarray(np.random.default_rng(1).random((n, n), dtype=np.float32).astype(np_dtype))
    out = xp.empty((n, n), dtype=np_dtype)

    def matmul(_: int) -> None:
        xp.matmul(a, b, out=out)

    samples = measure(matmul, policy, sync=sync)
    return {"method": f"{xp.__name__}.matmul {dtype} {n}^3", "dtype": dtype, "n": n, **samples.as_dict(),
            "gflops": 2 * n**3 / samples.median / 1e9}
