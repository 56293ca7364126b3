"""Every kernel specialisation compiles as HIP for gfx90a, gfx942 and gfx1100, with the text HIPRTC would get.

HIPRTC is clang with the HIP headers built in; the check runs clang (>= 17,
e.g. Debian's ``clang-19``) in HIP mode over the HIP headers (Debian's
``libamdhip64-dev``) on exactly the translation unit the launcher hands to
``cupy.RawModule`` (:func:`hal_cupy.kernel_source`: hal-rocm's prelude, then
the kernel file with its hal headers inlined) and the platform's options (``-munsafe-fp-atomics``). Each
specialisation is compiled device-only to AMDGPU assembly without linking
the ROCm device libraries (``-S -nogpulib``): parsing, the prelude, the
target's builtins and ISA generation are all covered. Specialisations for
CDNA (gfx90a, gfx942) use 64 lanes, for RDNA3 (gfx1100) 32, as the devices'
``warpSize`` says; the emitted wavefront size is checked too.

No compiler: the tests skip with the reason, or fail where
``HAL_REQUIRE_COMPILERS=1`` (CI). All compiles run once per session, in
parallel, cached by a hash of (source text, options, target, compiler). The
HIP headers are parsed once per target into a precompiled header (about
half of each compile's time otherwise); a compiler that cannot build one
compiles without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hal_cupy import Specialization, all_specializations, kernel_source
from hal_cupy.ops._quantized_gemm_rules import quant_gemm_spec
from hal_cupy.ops._write_kv_cache_rules import write_kv_cache_spec
from hal_cupy.testing import missing_compiler
from hal_rocm import ROCM

#: (target, wavefront size the HIP runtime reports for it).
TARGETS = (("gfx90a", 64), ("gfx942", 64), ("gfx1100", 32))
#: Compilers tried in order (``HAL_HIP_CLANG`` first when set); clang 17+ knows gfx942.
CANDIDATES = ("clang-19", "clang-20", "clang-21", "clang-18", "clang-17", "clang")
BASE_FLAGS = ("-x", "hip", "--cuda-device-only", "-S", "-nogpulib", "-O3", "-std=c++17", "-Wno-pass-failed",
              "-Wno-unused-command-line-argument")
#: Every specialisation HIP builds: none with ``min_sm`` (ROCm's platform has no warp matrix instructions, so the
#: tensor-core sources are never selected or built there).
JOBS = [(spec, target, wave) for target, wave in TARGETS for spec in all_specializations(wave) if spec.min_sm == 0]
_PROBE = '#include <hip/hip_runtime.h>\nextern "C" __global__ void probe(float* p) { atomicAdd(p, 1.0f); }\n'


def _try_compiler(path: str, workdir: Path) -> str:
    """Empty when ``path`` compiles HIP (with the HIP headers) for every target, else why not."""
    source = workdir / "probe.hip"
    source.write_text(_PROBE)
    for target, _ in TARGETS:
        cmd = [path, *BASE_FLAGS, f"--offload-arch={target}", str(source), "-o", str(workdir / "probe.s")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"{path} cannot compile HIP for {target}: {(proc.stderr.strip().splitlines() or ['?'])[0]}"
    return ""


@pytest.fixture(scope="session")
def hip_clang(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A clang that compiles HIP for every target, or a skip (a failure in CI) naming what was tried."""
    names = [os.environ["HAL_HIP_CLANG"]] if os.environ.get("HAL_HIP_CLANG") else list(CANDIDATES)
    problems = []
    workdir = tmp_path_factory.mktemp("hip-probe")
    for name in names:
        path = shutil.which(name)
        if path is None:
            continue
        problem = _try_compiler(path, workdir)
        if not problem:
            return path
        problems.append(problem)
    missing_compiler("no clang with HIP headers that knows gfx90a, gfx942 and gfx1100 "
                     f"({'; '.join(problems) or 'none of ' + ', '.join(names) + ' found'}); "
                     "on Debian: apt-get install clang-19 libamdhip64-dev")


def _header(clang: str, cache: Path, target: str) -> tuple[str, ...]:
    """Options that include the HIP headers precompiled for ``target``; empty when clang cannot build them."""
    source, pch = cache / f"hip_headers-{target}.hip", cache / f"hip_headers-{target}.pch"
    source.write_text("#include <hip/hip_runtime.h>\n")
    cmd = [clang, *BASE_FLAGS, f"--offload-arch={target}", *ROCM.compile_options(fmad=True),
           "-Xclang", "-emit-pch", str(source), "-o", str(pch)]
    if subprocess.run(cmd, capture_output=True, text=True).returncode != 0 or not pch.exists():
        return ()
    return ("-Xclang", "-include-pch", "-Xclang", str(pch))


def _compile(clang: str, cache: Path, spec: Specialization, target: str,
             header: tuple[str, ...] = ()) -> dict[str, Any]:
    source = kernel_source(spec, ROCM)
    options = (*ROCM.compile_options(fmad=True), *source.options)
    key = hashlib.sha256("\0".join((source.code, *options, target, clang)).encode()).hexdigest()[:32]
    hit = cache / f"{key}.json"
    if hit.exists():
        return json.loads(hit.read_text())
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        path = Path(tmp) / f"{spec.source.rsplit('.', 1)[0]}.hip"
        path.write_text(source.code)
        cmd = [clang, *BASE_FLAGS, f"--offload-arch={target}", *options, *header, str(path),
               "-o", str(Path(tmp) / "k.s")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        asm = (Path(tmp) / "k.s").read_text() if proc.returncode == 0 else ""
    result = {
        "rc": proc.returncode,
        "log": " ".join(cmd) + "\n" + proc.stdout + proc.stderr,
        "kernels": sorted(set(re.findall(r"^(hal_\w+):", asm, re.M))),
        "wavefront_sizes": sorted(set(re.findall(r"\.wavefront_size:\s+(\d+)", asm))),
        "dot4": len(re.findall(r"\bv_dot4c?_i32_(?:i8|iu8)", asm)),
        "atomic_add_f32": len(re.findall(r"\bglobal_atomic_add_f32\b", asm)),
        "atomic_cmpswap": len(re.findall(r"\bglobal_atomic_cmpswap\b", asm)),
    }
    hit.write_text(json.dumps(result))
    return result


@pytest.fixture(scope="session")
def compiled(hip_clang: str, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """Every (specialisation, target) compiled once, in parallel."""
    cache = tmp_path_factory.mktemp("hip-cache")
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        headers = dict(zip([t for t, _ in TARGETS], pool.map(lambda t: _header(hip_clang, cache, t),
                                                               [t for t, _ in TARGETS]), strict=True))
        done = list(pool.map(lambda job: _compile(hip_clang, cache, job[0], job[1], headers[job[1]]), JOBS))
    return {(spec.id, target): result for (spec, target, _), result in zip(JOBS, done, strict=True)}


@pytest.mark.parametrize(("spec", "target", "wave"), JOBS, ids=[f"{t}-{s.id}" for s, t, _ in JOBS])
def test_hip_compiles(compiled: dict, spec: Specialization, target: str, wave: int) -> None:
    """The specialisation builds for the target with every entry point, at the device's wavefront size."""
    result = compiled[(spec.id, target)]
    assert result["rc"] == 0, result["log"]
    missing = set(spec.kernels) - set(result["kernels"])
    assert not missing, f"kernels missing from the output: {sorted(missing)}\n{result['log']}"
    assert result["wavefront_sizes"] == [str(wave)], f"wavefront sizes {result['wavefront_sizes']}, expected {wave}"


@pytest.mark.parametrize(("target", "wave"), TARGETS, ids=[t for t, _ in TARGETS])
def test_w8a8_uses_the_dot_product_unit(compiled: dict, target: str, wave: int) -> None:
    """The int8 GEMM's byte dot products become v_dot4 instructions (signed on CDNA, mixed-sign on RDNA3)."""
    spec = quant_gemm_spec("float16", 8, 4, wave)
    assert compiled[(spec.id, target)]["dot4"] > 0, compiled[(spec.id, target)]["log"]


@pytest.mark.parametrize(("target", "wave"), TARGETS, ids=[t for t, _ in TARGETS])
def test_split_k_gemm_uses_no_atomics(compiled: dict, target: str, wave: int) -> None:
    """The quantised GEMMs store each K split's partials (summed in split order afterwards): no float atomic and
    no compare-and-swap loop in any of them, so a result does not depend on the order the CTAs run in."""
    specs = [s for s in all_specializations(wave) if s.source == "quant_gemm.cu"]
    assert specs
    for spec in specs:
        result = compiled[(spec.id, target)]
        assert result["atomic_add_f32"] == 0 and result["atomic_cmpswap"] == 0, result["log"]


def test_wrong_wavefront_size_does_not_compile(hip_clang: str, tmp_path: Path) -> None:
    """A 64-lane specialisation for a wave32 target stops at the prelude's check instead of dropping lanes."""
    result = _compile(hip_clang, tmp_path, write_kv_cache_spec(True, 64), "gfx1100")
    assert result["rc"] != 0
    assert "HAL_WARP_SIZE does not match the target's wavefront size" in result["log"]
