"""Every kernel specialisation compiles with NVRTC for sm_80, sm_90 and sm_120, from the translation unit the runtime
compiles (:func:`hal_cupy.kernel_source` with the CUDA prelude).

Runs without a GPU (importing hal_cuda imports no CuPy).  All compiles run once, in a process pool, when the module is
first used; each parametrised test then reports its own result.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pytest
from hal_cuda import _nvrtc as nvrtc_mod
from hal_cupy import all_specializations
from hal_cupy.testing import missing_compiler

ARCHS = ("sm_80", "sm_90", "sm_120")
SPECS = all_specializations()


def _compile(job):
    spec, arch = job
    try:
        res = nvrtc_mod.compile_specialization(spec, arch, resources=True)
    except nvrtc_mod.NvrtcError as exc:
        return ("error", str(exc), {})
    return ("ok", res.log, {k: (r.registers, r.spill_stores + r.spill_loads) for k, r in res.kernels.items()})


@pytest.fixture(scope="module")
def results():
    try:
        nvrtc_mod.nvrtc_version()
    except nvrtc_mod.NvrtcUnavailable as exc:
        missing_compiler(f"NVRTC Python packages not installed (cuda-bindings, nvidia-cuda-nvrtc): {exc}")
    jobs = [(s, a) for s in SPECS for a in ARCHS]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        out = list(pool.map(_compile, jobs, chunksize=4))
    return dict(zip(jobs, out, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_compiles(results, spec, arch):
    status, log, kernels = results[(spec, arch)]
    assert status == "ok", log
    missing = set(spec.kernels) - set(kernels)
    assert not missing, f"kernels missing from the cubin: {sorted(missing)}\n{log}"
