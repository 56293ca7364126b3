"""Host-compiled kernels: the real ``hal_cupy/kernels`` sources built for the CPU with g++.

Each kernel file's translation unit is put together by the rule every GPU
compile follows (:func:`hal_cupy._kernel_sources.translation_unit`), with
``prelude_host.cuh`` as the prelude (a third vendor prelude that runs CTA
threads as fibers, see its header): the host prelude, then the kernel file
with its hal headers inlined.  g++ compiles it ahead of a small
``*_host.cpp`` shim (``-include``) exporting one
``launch_<kernel>(grid, block, args...)`` C function per kernel.  Builds go to
a directory the caller owns and are cached by (hash of the unit, the shim and
the host headers, defines).

This is not :mod:`kernel_emulator` (numpy re-implementations of the kernels
used to test host wiring): here the kernel code itself runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from hal_cupy._kernel_params import KERNEL_PARAMS
from hal_cupy._kernel_sources import translation_unit

__all__ = [
    "HOST_DIR",
    "HostBuildError",
    "HostKernelBuilder",
    "HostLaunchError",
    "HostModule",
    "toolchain_problem",
]

#: Directory of the host prelude and shims.
HOST_DIR = Path(__file__).resolve().parent

_SHIMS = {
    "paged_attention.cu": "paged_attention_host.cpp",
    "write_kv_cache.cu": "write_kv_cache_host.cpp",
    "quant_gemm.cu": "quant_gemm_host.cpp",
    "quant_util.cu": "quant_util_host.cpp",
    "quant_gemm_tc.cu": "quant_gemm_tc_host.cpp",
    "paged_attention_tc.cu": "paged_attention_tc_host.cpp",
    "sample.cu": "sample_host.cpp",
    "rms_norm.cu": "rms_norm_host.cpp",
    "gated_activation.cu": "gated_activation_host.cpp",
    "rotary_embedding.cu": "rotary_embedding_host.cpp",
    "fused_moe.cu": "fused_moe_host.cpp",
}

# ctypes parameter kinds after (grid, block), in kernel parameter order, from the kernels' declarations
# (hal_cupy._kernel_params): p = pointer (numpy array or None), f = float32, i = int32, q = int64.
_KINDS = {"float": "f", "int": "i", "hal_i64": "q", "long long": "q"}
_SIGNATURES: dict[str, str] = {
    kernel: "".join("p" if ctype.endswith("*") else _KINDS[ctype] for _, ctype in params)
    for kernel, params in KERNEL_PARAMS.items()
}
_CTYPES = {"p": ctypes.c_void_p, "f": ctypes.c_float, "i": ctypes.c_int, "q": ctypes.c_longlong}
_UINT3 = ctypes.c_uint * 3

_FLAGS = (
    "-std=c++17",
    "-O1",
    "-shared",
    "-fPIC",
    "-fno-strict-aliasing",  # the kernels reinterpret byte buffers, as GPU code may
    "-ffp-contract=off",  # no FMA contraction: one rounding per operation
    "-Wall",
    "-Wno-unknown-pragmas",  # #pragma unroll
)


class HostBuildError(RuntimeError):
    """g++ rejected a kernel source (a real failure, not a reason to skip)."""


class HostLaunchError(RuntimeError):
    """The host runtime refused a launch or found a deadlock."""


def _compiler() -> str | None:
    return shutil.which("g++")


def toolchain_problem(work_dir: Path) -> str | None:
    """Why host-compiled kernels cannot run here (None when they can): no g++, or the prelude does not build."""
    cxx = _compiler()
    if cxx is None:
        return "g++ not found on PATH"
    out = work_dir / "probe_host.so"
    cmd = [cxx, *_FLAGS, f"-I{HOST_DIR}", str(HOST_DIR / "probe_host.cpp"), "-o", str(out)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"g++ could not run: {exc}"
    if res.returncode != 0:
        first = next((line for line in res.stderr.splitlines() if "error" in line), res.stderr.strip()[:200])
        return f"g++ cannot build the host prelude (C++17, <ucontext.h>, _Float16 needed): {first}"
    return None


def _pointer(value: Any) -> ctypes.c_void_p:
    if value is None:
        return ctypes.c_void_p(None)
    if not isinstance(value, np.ndarray):
        raise TypeError(f"expected a numpy array or None for a pointer, got {type(value).__name__}")
    if not value.flags.c_contiguous and (value.ndim == 0 or value.strides[-1] != value.itemsize):
        raise ValueError("kernel arrays must be C-contiguous, or strided views with a contiguous last dimension")
    return ctypes.c_void_p(value.ctypes.data)


class HostModule:
    """One compiled specialisation: launch its kernels with a plugin :class:`Launch`."""

    def __init__(self, path: Path, defines: Mapping[str, str]) -> None:
        self.path = path
        self.defines = dict(defines)
        self._lib = ctypes.CDLL(str(path))
        self._lib.hal_host_seed.argtypes = [ctypes.c_ulonglong]

    def seed(self, seed: int) -> None:
        """Seed the thread interleaving between synchronisation points."""
        self._lib.hal_host_seed(seed & 0xFFFFFFFFFFFFFFFF)

    def shuffle_ctas(self, on: bool = True) -> None:
        """Run each launch's CTAs in a random order drawn from the seed (default: x fastest, then y, z)."""
        self._lib.hal_host_shuffle_ctas.argtypes = [ctypes.c_int]
        self._lib.hal_host_shuffle_ctas(int(on))

    def warp_size(self) -> int:
        """HAL_WARP_SIZE the module was built with."""
        return int(self._lib.hal_host_warp_size())

    def static_shared_bytes(self) -> int:
        """Static shared memory the module's kernels declare (paged attention, quantised GEMM)."""
        return int(self._lib.static_shared_bytes())

    def launch(self, launch: Any, *args: Any) -> None:
        """Run ``launch.kernel`` over ``launch.grid`` x ``launch.block`` with the kernel's parameters."""
        kinds = _SIGNATURES[launch.kernel]
        if len(args) != len(kinds):
            raise TypeError(f"{launch.kernel} takes {len(kinds)} arguments, got {len(args)}")
        if launch.shared_mem != 0:
            raise HostLaunchError(f"{launch.kernel}: the kernels use no dynamic shared memory")
        if min(launch.grid) < 1:
            raise HostLaunchError(f"{launch.kernel}: empty grid {launch.grid} (the host must not launch)")
        fn = getattr(self._lib, f"launch_{launch.kernel}")
        fn.argtypes = [_UINT3, _UINT3, *(_CTYPES[k] for k in kinds)]
        fn.restype = ctypes.c_int
        converted = [_pointer(a) if k == "p" else a for k, a in zip(kinds, args, strict=True)]
        rc = fn(_UINT3(*launch.grid), _UINT3(*launch.block), *converted)
        if rc == -1:
            raise HostLaunchError(f"{launch.kernel}: unsupported block {launch.block}")
        if rc == -2:
            raise HostLaunchError(f"{launch.kernel}: deadlock (a barrier or shuffle not reached by every thread)")
        if rc != 0:
            raise HostLaunchError(f"{launch.kernel}: launch failed ({rc})")


class HostKernelBuilder:
    """Compiles kernel sources of ``hal_cupy.kernels`` into ``build_dir``, caching by (source hash, defines)."""

    def __init__(self, build_dir: Path) -> None:
        cxx = _compiler()
        if cxx is None:
            raise HostBuildError("g++ not found on PATH")
        self.cxx = cxx
        self.build_dir = build_dir
        self._modules: dict[tuple[str, tuple[tuple[str, str], ...]], HostModule] = {}

    def build(self, source: str, defines: Mapping[str, str | int]) -> HostModule:
        """The module of ``source`` (a kernel file name, e.g. ``paged_attention.cu``) with ``defines``."""
        unit = translation_unit(source, (HOST_DIR / "prelude_host.cuh").read_text())
        digest = hashlib.sha256(unit.encode())
        for f in (HOST_DIR / "mma_host.cuh", HOST_DIR / _SHIMS[source]):  # included by the prelude; the shim
            digest.update(b"\0" + f.name.encode() + b"\0" + f.read_bytes())
        defs = tuple(sorted((k, str(v)) for k, v in defines.items()))
        key = (digest.hexdigest(), defs)
        module = self._modules.get(key)
        if module is not None:
            return module
        tag = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        stem = source.rsplit(".", 1)[0]
        unit_path = self.build_dir / f"{stem}_{key[0][:16]}.cu"
        unit_path.write_text(unit)
        out = self.build_dir / f"{stem}_{tag}.so"
        cmd = [
            self.cxx,
            *_FLAGS,
            f"-I{HOST_DIR}",
            *(f"-D{k}={v}" for k, v in defs),
            "-include",
            str(unit_path),
            str(HOST_DIR / _SHIMS[source]),
            "-o",
            str(out),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise HostBuildError(f"{' '.join(cmd)}\n{res.stderr}")
        module = HostModule(out, dict(defs))
        self._modules[key] = module
        return module

    def build_probe(self, warp_size: int) -> ctypes.CDLL:
        """``probe_host.cpp`` (the host prelude's self-check) built for ``warp_size`` lanes."""
        out = self.build_dir / f"probe_host_w{warp_size}.so"
        cmd = [self.cxx, *_FLAGS, f"-DHAL_WARP_SIZE={warp_size}", f"-I{HOST_DIR}", str(HOST_DIR / "probe_host.cpp"),
               "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise HostBuildError(f"{' '.join(cmd)}\n{res.stderr}")
        lib = ctypes.CDLL(str(out))
        lib.probe_shuffle.argtypes = [ctypes.c_void_p]
        return lib

    def build_mma_probe(self) -> ctypes.CDLL:
        """``mma_probe_host.cpp``: single-instruction probes of the warp matrix emulation (32-lane warps)."""
        digest = hashlib.sha256(b"".join((HOST_DIR / f).read_bytes() for f in
                                         ("prelude_host.cuh", "mma_host.cuh", "mma_probe_host.cpp"))).hexdigest()[:16]
        out = self.build_dir / f"mma_probe_{digest}.so"
        if not out.exists():
            cmd = [self.cxx, *_FLAGS, f"-I{HOST_DIR}", str(HOST_DIR / "mma_probe_host.cpp"), "-o", str(out)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise HostBuildError(f"{' '.join(cmd)}\n{res.stderr}")
        lib = ctypes.CDLL(str(out))
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.probe_mma_m16n8k16.argtypes = [p, p, p, p, i]
        lib.probe_mma_m16n8k8.argtypes = [p, p, p, p, i]
        lib.probe_mma_m16n8k32_s8.argtypes = [p, p, p, p]
        lib.probe_ldmatrix.argtypes = [p, p, i, i, p]
        lib.probe_cp_async.argtypes = [p, p, i, p]
        lib.probe_tile_product.argtypes = [p, p, p, p, i]
        lib.probe_b16x2.argtypes = [i, p, p, p, p, i]
        lib.probe_b16x2.restype = None
        return lib
