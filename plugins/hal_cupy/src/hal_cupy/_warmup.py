"""Fill CuPy's kernel disk cache ahead of time, compiling specialisations in parallel processes.

Kernels compile on first use, which costs about a second each with NVRTC or
HIPRTC. ``python -m hal_cupy._warmup BACKEND [PROCESSES]`` (or
:func:`precompile`) compiles the whole catalogue (or a chosen list) for
device 0's architecture and SIMD width in worker processes; later processes
load the binaries from ``~/.cupy/kernel_cache`` (``CUPY_CACHE_DIR``)
instead of compiling.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from ._kernel_sources import kernel_source
from ._platform import GpuPlatform
from ._specialization import Specialization
from .ops import all_specializations

__all__ = ["precompile"]


def _compile_one(spec: Specialization, platform: GpuPlatform, device_index: int, fmad: bool) -> str:
    from ._cupy import cupy

    cp = cupy()
    source = kernel_source(spec, platform)
    options = (*source.options, *platform.compile_options(fmad=fmad))
    with cp.cuda.Device(device_index):
        module = cp.RawModule(code=source.code, options=options)
        module.compile()
        for name in source.entry_points:
            module.get_function(name)
    return spec.id


def precompile(platform: GpuPlatform, specs: Sequence[Specialization] | None = None, *,
               processes: int | None = None, device_index: int = 0, fmad: bool | None = None) -> tuple[int, float]:
    """Compile ``specs`` (default: the catalogue at the device's SIMD width) into CuPy's disk cache.

    The default leaves out the specialisations whose ``min_sm`` the device's warp matrix instructions do not
    reach (:meth:`GpuPlatform.warp_mma_level`).

    Returns ``(count, seconds)``.
    """
    from . import _env
    from ._device import query_capabilities

    if specs is None:
        caps = query_capabilities(device_index, platform)
        level = platform.warp_mma_level(caps)
        specs = [s for s in all_specializations(caps.simd_width) if s.min_sm <= level]
    specs = list(specs)
    fmad = _env.fmad(platform.name) if fmad is None else fmad
    workers = max(1, min(len(specs), processes or (os.cpu_count() or 1)))
    start = time.perf_counter()
    from concurrent.futures import ProcessPoolExecutor  # only here: multiprocessing is slow to import
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        done = list(pool.map(_compile_one, specs, [platform] * len(specs), [device_index] * len(specs),
                             [fmad] * len(specs)))
    return len(done), time.perf_counter() - start


if __name__ == "__main__":  # pragma: no cover - a command-line convenience
    import hal_core

    from ._backend import CupyBackend

    backend = hal_core.get_backend(sys.argv[1] if len(sys.argv) > 1 else None)
    if not isinstance(backend, CupyBackend):
        raise SystemExit(f"hal-cupy: backend {backend.name!r} is not a GPU backend of hal-cupy")
    count, seconds = precompile(backend.platform, processes=int(sys.argv[2]) if len(sys.argv) > 2 else None)
    print(f"hal-cupy: {count} specialisations compiled for {backend.name} into CuPy's kernel cache in {seconds:.1f} s")
