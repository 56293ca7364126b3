"""The kernel sources also compile as HIP (ROCm prelude) for AMD targets.

Needs ``hipcc`` with the AMD platform (e.g. Debian's ``hipcc`` package); skipped
otherwise.  Each specialisation is compiled device-only to AMDGPU assembly
without linking the ROCm device libraries (``-S -nogpulib``), so the check
covers parsing, the prelude and ISA code generation even where the installed
device libraries lack a target.  RDNA targets (gfx11) build with
``-DHAL_WARP_SIZE=32``; the emitted wavefront size is checked as well.

Set ``HAL_HIP_COMPILE_ALL=1`` to compile the whole catalogue; by default one
representative set per source (every head size, dtype and option once) is used.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hal_cuda import _specializations as S

#: (target, wavefront size); gfx940 stands in for CDNA3 where the compiler predates gfx942.
TARGETS = (("gfx90a", 64), ("gfx942", 64), ("gfx940", 64), ("gfx1100", 32))


def _selected():
    specs = [s for s in S.all_specializations() if s.min_sm == 0]  # min_sm > 0: CUDA-only tensor-core sources
    if os.environ.get("HAL_HIP_COMPILE_ALL") == "1":
        return specs
    # Each define value at least once per source.
    seen: set[tuple[str, str, str]] = set()
    out = []
    for s in specs:
        keys = {(s.source, k, v) for k, v in s.defines}
        if not keys <= seen:
            seen |= keys
            out.append(s)
    return out


SPECS = _selected()
HIPCC = shutil.which("hipcc")


def _compile(spec, target, wave):
    kdir = S.kernel_source_dir()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.s"
        cmd = [
            HIPCC, "-x", "hip", f"--offload-arch={target}", "--cuda-device-only", "-S", "-nogpulib",
            "-O3", "-Wno-pass-failed", "-Wno-unused-command-line-argument",
            "-include", str(kdir / "prelude_hip.cuh"), f"-I{kdir}", f"-DHAL_WARP_SIZE={wave}",
            *spec.options(), str(kdir / spec.source), "-o", str(out),
        ]  # fmt: skip
        env = dict(os.environ, HIP_PLATFORM="amd")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        asm = out.read_text() if proc.returncode == 0 and out.exists() else ""
    return proc.returncode, " ".join(cmd) + "\n" + proc.stdout + proc.stderr, asm


@pytest.fixture(scope="module")
def supported_targets():
    if HIPCC is None:
        pytest.skip("hipcc not found (install ROCm or Debian's hipcc, HIP_PLATFORM=amd)")
    ok = {}
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.hip"
        probe.write_text("__global__ void probe() {}\n")
        for target, _ in TARGETS:
            proc = subprocess.run(
                [HIPCC, "-x", "hip", f"--offload-arch={target}", "--cuda-device-only", "-S",
                 "-nogpulib", str(probe), "-o", str(Path(tmp) / "probe.s")],
                capture_output=True, text=True, env=dict(os.environ, HIP_PLATFORM="amd"),
            )  # fmt: skip
            ok[target] = "invalid target" not in proc.stderr
    return ok


@pytest.fixture(scope="module")
def results(supported_targets):
    jobs = [(s, t, w) for s in SPECS for t, w in TARGETS if supported_targets[t]]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = list(pool.map(lambda j: _compile(*j), jobs))
    return {(s.id, t): r for (s, t, _), r in zip(jobs, done, strict=True)}


@pytest.mark.parametrize(("target", "wave"), TARGETS, ids=[t for t, _ in TARGETS])
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_hip_compiles(results, supported_targets, spec, target, wave):
    if not supported_targets[target]:
        pytest.skip(f"this hipcc does not know {target}")
    rc, log, asm = results[(spec.id, target)]
    assert rc == 0, log
    for kernel in spec.kernels:
        assert re.search(rf"^{kernel}:", asm, re.M), f"{kernel} missing from the output\n{log}"
    sizes = set(re.findall(r"\.wavefront_size:\s+(\d+)", asm))
    assert sizes == {str(wave)}, f"wavefront sizes {sizes}, expected {wave}"
