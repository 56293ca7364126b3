"""Every kernel specialisation compiles with NVRTC for sm_80, sm_90 and sm_120.

Runs without a GPU.  The catalogue and compiler wrapper are loaded straight
from their files so the check does not need the plugin's runtime
dependencies.  All compiles run once, in a process pool, when the module is
first used; each parametrised test then reports its own result.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

_PKG = Path(__file__).resolve().parents[1] / "src" / "hal_cuda"
ARCHS = ("sm_80", "sm_90", "sm_120")


def _load(name: str):
    mod_name = f"_hal_cuda_offline_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, _PKG / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


specs_mod = _load("_specializations")
nvrtc_mod = _load("_nvrtc")
SPECS = specs_mod.all_specializations()


def _compile(job):
    source, options, arch = job
    kdir = specs_mod.kernel_source_dir()
    try:
        res = nvrtc_mod.compile_kernel_file(kdir, source, options, arch, resources=True)
    except nvrtc_mod.NvrtcError as exc:
        return ("error", str(exc), {})
    return ("ok", res.log, {k: (r.registers, r.spill_stores + r.spill_loads) for k, r in res.kernels.items()})


@pytest.fixture(scope="module")
def results():
    try:
        nvrtc_mod.nvrtc_version()
    except nvrtc_mod.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC Python packages not installed (cuda-bindings, nvidia-cuda-nvrtc): {exc}")
    jobs = [(s.source, s.options(), a) for s in SPECS for a in ARCHS]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        out = list(pool.map(_compile, jobs, chunksize=4))
    return dict(zip(jobs, out, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_compiles(results, spec, arch):
    status, log, kernels = results[(spec.source, spec.options(), arch)]
    assert status == "ok", log
    missing = set(spec.kernels) - set(kernels)
    assert not missing, f"kernels missing from the cubin: {sorted(missing)}\n{log}"
