"""Is ROCm usable here?  Answered with ctypes, before any CuPy import, on a host with no GPU.

Order of the checks, each a specific reason when it fails:

1. The HIP runtime ``libamdhip64.so`` loads (ctypes; ``$ROCM_PATH/lib`` and
   ``/opt/rocm/lib`` are tried after the loader's search path).
2. ``hipInit(0)`` succeeds and ``hipGetDeviceCount`` finds a device. When it
   finds none and ``HIP_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES`` (or
   ``CUDA_VISIBLE_DEVICES``, which HIP also honours) is set, the reason names
   the variable that hides them. ``hipRuntimeGetVersion`` gives the ROCm major.
3. CuPy for ROCm is installed, for the same ROCm major: read from the
   installed distributions' names (``cupy-rocm-7-0``), nothing imported. A
   CUDA build of CuPy, or none, is a reason with the pip command.
4. Only now CuPy is imported and asked whether it is a HIP build.

Nothing here changes the environment or creates a device context.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["PIP_INSTALL", "RUNTIME_LIBRARIES", "ProbeResult", "cupy_distributions", "hidden_by_visible_devices",
           "probe"]

#: The HIP runtime, by the names it is installed under (the unversioned name comes with the -dev package).
RUNTIME_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")
#: The ROCm major the ``cupy`` extra installs CuPy for.
CUPY_ROCM_MAJOR = 7
PIP_INSTALL = "pip install hal-rocm[cupy]  (installs cupy-rocm-7-0, CuPy built for ROCm 7)"

# hipError_t codes (hip_runtime_api.h) the probe names.
_HIP_SUCCESS = 0
_HIP_ERROR_INSUFFICIENT_DRIVER = 35
_HIP_ERROR_NO_DEVICE = 100
_HIP_ERROR_INVALID_DEVICE = 101

_VISIBILITY = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
_CUPY_ROCM = re.compile(r"^cupy-rocm-(\d+)-(\d+)$")


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found; ``ok`` with empty ``reason`` when ROCm is usable."""

    ok: bool
    reason: str = ""
    remedy: str = ""
    device_count: int = 0
    runtime_version: int = 0  # HIP_VERSION encoding: major * 10**7 + minor * 10**5 + patch
    library: str = ""


def _rocm_major(version: int) -> int:
    return version // 10_000_000


def _version_text(version: int) -> str:
    return f"{version // 10_000_000}.{version // 100_000 % 100}"


def hidden_by_visible_devices(environ: Any = None) -> str:
    """Why a visibility variable hides every GPU, or empty when none does (or none is set).

    An empty value hides every device, and so does a first entry that is
    negative or not a device index (``ROCR_VISIBLE_DEVICES`` also takes
    ``GPU-`` UUIDs); the runtimes enumerate up to the first invalid entry.
    """
    env = os.environ if environ is None else environ
    for name in _VISIBILITY:
        value = env.get(name)
        if value is None:
            continue
        first = value.split(",")[0].strip()
        if not value.strip():
            return f"{name} is set but empty, which hides every GPU"
        if first.isdigit() or (name == "ROCR_VISIBLE_DEVICES" and first.startswith("GPU-")):
            continue
        if first.lstrip("-").isdigit():
            return f"{name}={value!r} starts with a negative index, which hides every GPU"
        return f"{name}={value!r} starts with an invalid entry {first!r}, which hides every GPU"
    return ""


def _load_runtime(loader: Callable[[str], Any], environ: Any) -> tuple[Any, str, list[str]]:
    tried: list[str] = []
    roots = [r for r in (environ.get("ROCM_PATH"), "/opt/rocm") if r]
    candidates = [*RUNTIME_LIBRARIES, *(os.path.join(r, "lib", n) for r in roots for n in RUNTIME_LIBRARIES)]
    for name in candidates:
        try:
            return loader(name), name, tried
        except OSError as exc:
            tried.append(f"{name}: {exc}")
    return None, "", tried


def cupy_distributions() -> list[str]:
    """Names of the installed distributions that provide CuPy (``cupy``, ``cupy-cuda12x``, ``cupy-rocm-7-0`` ...)."""
    import importlib.metadata  # only once a HIP runtime and a device were found: it is slow to import

    names = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "cupy" or name.startswith(("cupy-cuda", "cupy-rocm")):
            names.add(name)
    return sorted(names)


def _cupy_build_problem(dists: Iterable[str], runtime_major: int) -> tuple[str, str]:
    """(reason, remedy) when the installed CuPy builds do not fit ROCm ``runtime_major``; empty when one does."""
    dists = list(dists)
    rocm = {d: int(m.group(1)) for d in dists if (m := _CUPY_ROCM.match(d))}
    if any(major == runtime_major for major in rocm.values()) or "cupy" in dists:
        return "", ""  # a matching wheel, or a source build (checked after import)
    if rocm:
        found = ", ".join(f"{d} (ROCm {major})" for d, major in sorted(rocm.items()))
        return (f"CuPy is built for another ROCm major: {found}, but the HIP runtime here is ROCm {runtime_major}",
                f"pip uninstall {' '.join(sorted(rocm))} && pip install cupy-rocm-{runtime_major}-0"
                if runtime_major != CUPY_ROCM_MAJOR else PIP_INSTALL)
    if dists:
        return (f"the installed CuPy ({', '.join(dists)}) is built for CUDA, not ROCm",
                f"pip uninstall {' '.join(dists)} && {PIP_INSTALL}")
    return "CuPy for ROCm is not installed", PIP_INSTALL


def probe(
    *,
    loader: Callable[[str], Any] = ctypes.CDLL,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
    distributions: Callable[[], Iterable[str]] = cupy_distributions,
    import_cupy: Callable[[], Any] | None = None,
    environ: Any = None,
) -> ProbeResult:
    """Check the HIP runtime, the devices and CuPy for ROCm, in that order (see the module docs).

    The keyword arguments exist for tests: a fake ``loader`` stands in for
    ``ctypes.CDLL``; ``find_spec``, ``distributions`` and ``import_cupy`` for
    the import machinery and the installed distributions.
    """
    env = os.environ if environ is None else environ
    hidden = hidden_by_visible_devices(env)
    visible = {n: env[n] for n in _VISIBILITY if env.get(n) is not None}
    unhide = f"unset {' / '.join(visible) or 'HIP_VISIBLE_DEVICES'} or list a valid GPU index in it"
    lib, library, tried = _load_runtime(loader, env)
    if lib is None:
        return ProbeResult(False, f"the HIP runtime (libamdhip64.so) was not found ({'; '.join(tried[:2])})",
                           "install ROCm (its HIP runtime), or run on a machine with an AMD GPU")
    rc = int(lib.hipInit(0))
    if rc == _HIP_ERROR_NO_DEVICE and hidden:
        return ProbeResult(False, hidden, unhide, library=library)
    if rc in (_HIP_ERROR_NO_DEVICE, _HIP_ERROR_INVALID_DEVICE):
        return ProbeResult(False, f"the HIP runtime found no AMD GPU (hipInit returned hipError {rc}; "
                           "no /dev/kfd, or no supported device)",
                           "run on a machine with a supported AMD GPU and the amdgpu kernel driver", library=library)
    if rc == _HIP_ERROR_INSUFFICIENT_DRIVER:
        return ProbeResult(False, "the amdgpu kernel driver is too old for this HIP runtime (hipInit returned "
                           "hipErrorInsufficientDriver)", "upgrade the amdgpu driver (ROCm's amdgpu-dkms)",
                           library=library)
    if rc != _HIP_SUCCESS:
        return ProbeResult(False, f"hipInit failed with hipError {rc}", "check `rocminfo` and the ROCm install",
                           library=library)
    count = ctypes.c_int(0)
    rc = int(lib.hipGetDeviceCount(ctypes.byref(count)))
    if rc not in (_HIP_SUCCESS, _HIP_ERROR_NO_DEVICE):
        return ProbeResult(False, f"hipGetDeviceCount failed with hipError {rc}",
                           "check `rocminfo` and the ROCm install", library=library)
    if count.value < 1:
        if hidden or visible:
            names = ", ".join(f"{k}={v!r}" for k, v in visible.items())
            return ProbeResult(False, hidden or f"{names} names no existing GPU", unhide, library=library)
        return ProbeResult(False, "the HIP runtime reports no AMD GPU", "run on a machine with an AMD GPU",
                           library=library)
    version = ctypes.c_int(0)
    rc = int(lib.hipRuntimeGetVersion(ctypes.byref(version)))
    runtime = version.value if rc == _HIP_SUCCESS else 0
    found: dict[str, Any] = {"device_count": count.value, "runtime_version": runtime, "library": library}
    if find_spec("cupy") is None:
        return ProbeResult(False, "CuPy for ROCm is not installed", PIP_INSTALL, **found)
    if runtime:
        reason, remedy = _cupy_build_problem(distributions(), _rocm_major(runtime))
        if reason:
            return ProbeResult(False, reason, remedy, **found)
    try:
        cupy = import_cupy() if import_cupy is not None else importlib.import_module("cupy")
        is_hip = bool(getattr(cupy.cuda.runtime, "is_hip", False))
        cupy_runtime = int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception as exc:  # a broken CuPy install must be a reason, not a crash
        return ProbeResult(False, f"CuPy failed to import: {type(exc).__name__}: {exc}",
                           f"reinstall CuPy for ROCm: {PIP_INSTALL}", **found)
    if not is_hip:
        return ProbeResult(False, "the installed CuPy is built for CUDA, not ROCm", PIP_INSTALL, **found)
    if runtime and _rocm_major(cupy_runtime) != _rocm_major(runtime):
        return ProbeResult(False, f"CuPy runs HIP {_version_text(cupy_runtime)} but the HIP runtime found first is "
                           f"ROCm {_version_text(runtime)}", f"install the CuPy build for ROCm {_rocm_major(runtime)}",
                           **found)
    return ProbeResult(True, **found)
