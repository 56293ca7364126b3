"""Fill CuPy's kernel disk cache ahead of time, compiling specialisations in parallel processes.

Kernels compile on first use, which costs about a second each with NVRTC.
``python -m hal_cuda._warmup`` (or :func:`precompile`) compiles the whole
catalogue (or a chosen list) for device 0's architecture in worker
processes; later processes load the cubins from ``~/.cupy/kernel_cache``
(``CUPY_CACHE_DIR``) instead of compiling.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from ._specializations import Specialization, all_specializations

__all__ = ["precompile"]


def _compile_one(spec: Specialization, device_index: int, fmad: bool) -> str:
    from ._cupy import cupy
    from .ops._common import kernel_source

    cp = cupy()
    source = kernel_source(spec)
    options = (*source.options, *(() if fmad else ("-fmad=false",)))
    with cp.cuda.Device(device_index):
        module = cp.RawModule(code=source.code, options=options)
        module.compile()
        for name in source.entry_points:
            module.get_function(name)
    return spec.id


def _device_sm(device_index: int) -> int:
    """Compute capability of the device as major * 10 + minor (selects the tensor-core sources)."""
    from ._cupy import cupy

    return int(cupy().cuda.Device(device_index).compute_capability)


def precompile(specs: Sequence[Specialization] | None = None, *, processes: int | None = None,
               device_index: int = 0, fmad: bool | None = None) -> tuple[int, float]:
    """Compile ``specs`` (default: every catalogue entry) into CuPy's disk cache; ``(count, seconds)``."""
    from . import _env

    if specs is None:
        specs = [s for s in all_specializations() if s.min_sm <= _device_sm(device_index)]
    specs = list(specs)
    fmad = _env.fmad() if fmad is None else fmad
    workers = max(1, min(len(specs), processes or (os.cpu_count() or 1)))
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        done = list(pool.map(_compile_one, specs, [device_index] * len(specs), [fmad] * len(specs)))
    return len(done), time.perf_counter() - start


if __name__ == "__main__":  # pragma: no cover - a command-line convenience
    count, seconds = precompile(processes=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"hal-cuda: {count} specialisations compiled into CuPy's kernel cache in {seconds:.1f} s")
