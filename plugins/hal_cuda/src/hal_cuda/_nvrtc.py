"""Offline NVRTC compilation of the hal kernel sources (no GPU or driver needed).

Uses ``cuda.bindings.nvrtc`` (package ``cuda-bindings``) with the NVRTC
library from the ``nvidia-cuda-nvrtc`` wheel (CUDA 13; sm_80, sm_90 and
sm_120 are all supported).  The kernels need no CUDA headers.

:func:`compile_specialization` compiles the translation unit the runtime
compiler gets (:func:`hal_cupy.kernel_source` with the CUDA prelude: the
prelude, then the kernel file with its hal headers inlined between ``#line``
directives), with the specialisation's defines as its only options besides
the architecture; no include path is needed.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from hal_cupy import Specialization, kernel_source

from ._platform import CUDA

__all__ = [
    "NvrtcError",
    "NvrtcUnavailable",
    "KernelResources",
    "CompileResult",
    "nvrtc_version",
    "compile_source",
    "compile_specialization",
    "parse_ptxas_log",
]


class NvrtcUnavailable(RuntimeError):
    """The NVRTC Python bindings or library cannot be loaded."""


class NvrtcError(RuntimeError):
    """Compilation failed; ``log`` holds the complete NVRTC log."""

    def __init__(self, name: str, arch: str, options: tuple[str, ...], log: str) -> None:
        self.name, self.arch, self.options, self.log = name, arch, options, log
        super().__init__(f"NVRTC failed to compile {name} for {arch} with {' '.join(options)}:\n{log}")


@dataclass(frozen=True)
class KernelResources:
    """ptxas statistics of one entry function."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int  # static shared memory


@dataclass
class CompileResult:
    cubin: bytes
    log: str
    seconds: float
    kernels: dict[str, KernelResources] = field(default_factory=dict)


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise NvrtcUnavailable(f"cuda-bindings is not installed ({exc})") from exc
    try:
        err, _, _ = nvrtc.nvrtcVersion()
    except Exception as exc:  # pragma: no cover - library missing
        raise NvrtcUnavailable(f"the NVRTC library could not be loaded ({exc})") from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:  # pragma: no cover
        raise NvrtcUnavailable(f"nvrtcVersion failed: {err}")
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC; raises NvrtcUnavailable."""
    _, major, minor = _nvrtc().nvrtcVersion()
    return int(major), int(minor)


def _check(nvrtc, result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per-entry-function resources from ``--ptxas-options=-v`` output."""
    entries: set[str] = set(_ENTRY.findall(log))
    current: str | None = None
    stats: dict[str, dict[str, int]] = {}
    for line in log.splitlines():
        m = _ENTRY.search(line) or _PROPS.search(line)
        if m:
            current = m.group(1)
            stats.setdefault(current, {})
            continue
        if current is None:
            continue
        m = _STACK.search(line)
        if m:
            stats[current].update(stack=int(m[1]), st=int(m[2]), ld=int(m[3]))
            continue
        m = _USED.search(line)
        if m:
            stats[current].update(regs=int(m[1]), smem=int(m[2] or 0))
    return {
        name: KernelResources(
            name, s.get("regs", 0), s.get("st", 0), s.get("ld", 0), s.get("stack", 0), s.get("smem", 0)
        )
        for name, s in stats.items()
        if name in entries
    }


def compile_source(
    code: str,
    name: str,
    options: tuple[str, ...] | list[str],
    arch: str = "sm_90",
    resources: bool = True,
) -> CompileResult:
    """Compile ``code`` to a cubin for ``arch`` (e.g. ``"sm_90"``).

    Raises NvrtcError with the full log on failure.  With ``resources``,
    ptxas statistics are collected per entry function.
    """
    nvrtc = _nvrtc()
    opts = [f"--gpu-architecture={arch}", *options]
    if resources:
        opts.append("--ptxas-options=-v")
    err, prog = nvrtc.nvrtcCreateProgram(code.encode(), name.encode(), 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        start = time.perf_counter()
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        seconds = time.perf_counter() - start
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\x00 ").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NvrtcError(name, arch, tuple(opts), log)
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompileResult(cubin, log, seconds, parse_ptxas_log(log) if resources else {})


def compile_specialization(spec: Specialization, arch: str, resources: bool = True) -> CompileResult:
    """Compile ``spec``'s translation unit with the CUDA prelude for ``arch``, exactly as the runtime assembles it."""
    source = kernel_source(spec, CUDA)
    return compile_source(source.code, source.name, source.options, arch, resources)
