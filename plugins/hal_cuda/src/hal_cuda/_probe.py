"""Is CUDA usable here?  Answered without importing CuPy on a host with no GPU.

Order of the checks, each a specific reason when it fails:

1. ``CUDA_VISIBLE_DEVICES`` hides every device (empty, ``-1``, or an invalid
   first entry): read from the environment, nothing loaded.
2. The driver library ``libcuda.so.1`` loads (ctypes), ``cuInit(0)`` succeeds
   and ``cuDeviceGetCount`` finds a device; ``cuDriverGetVersion`` says which
   CUDA version the driver supports. ``cuInit`` creates no context.
3. CuPy is installed (``importlib.util.find_spec``; not imported).
4. Only now, with a driver and a device present, CuPy is imported and its
   CUDA runtime version compared with the driver's.

Nothing here changes the environment or creates a device context.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DRIVER_LIBRARY", "ProbeResult", "hidden_by_visible_devices", "probe"]

#: The CUDA driver library loaded by the probe.
DRIVER_LIBRARY = "libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll"

PIP_INSTALL = "pip install cupy-cuda12x  (or cupy-cuda13x on a CUDA 13 driver)"

# CUresult codes (cuda.h) the probe names.
_CUDA_SUCCESS = 0
_CUDA_ERROR_NO_DEVICE = 100
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35
_CUDA_ERROR_STUB_LIBRARY = 34
_CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found; ``ok`` with empty ``reason`` when CUDA is usable."""

    ok: bool
    reason: str = ""
    remedy: str = ""
    device_count: int = 0
    driver_version: int = 0  # e.g. 12040 for CUDA 12.4
    runtime_version: int = 0  # CuPy's CUDA runtime, when it was imported


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def hidden_by_visible_devices(environ: Any = None) -> str:
    """Why ``CUDA_VISIBLE_DEVICES`` hides every device, or empty when it does not (or is unset).

    The driver enumerates the listed devices up to the first invalid entry;
    an entry is an index >= 0 or a ``GPU-``/``MIG-`` UUID.
    """
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return ""
    first = value.split(",")[0].strip()
    if not value.strip():
        return "CUDA_VISIBLE_DEVICES is set but empty, which hides every GPU"
    if first.isdigit() or first.startswith(("GPU-", "MIG-")):
        return ""
    if first.lstrip("-").isdigit():
        return f"CUDA_VISIBLE_DEVICES={value!r} starts with a negative index, which hides every GPU"
    return f"CUDA_VISIBLE_DEVICES={value!r} starts with an invalid entry {first!r}, which hides every GPU"


def _load_driver(loader: Callable[[str], Any]) -> Any:
    return loader(DRIVER_LIBRARY)


def probe(
    *,
    loader: Callable[[str], Any] = ctypes.CDLL,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
    import_cupy: Callable[[], Any] | None = None,
    environ: Any = None,
) -> ProbeResult:
    """Check the driver, the devices and CuPy, in that order (see the module docs).

    The keyword arguments exist for tests: a fake ``loader`` stands in for
    ``ctypes.CDLL``, ``find_spec`` and ``import_cupy`` for the import machinery.
    """
    hidden = hidden_by_visible_devices(environ)
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    unhide = "unset CUDA_VISIBLE_DEVICES or list a valid GPU index in it"
    try:
        lib = _load_driver(loader)
    except OSError as exc:
        return ProbeResult(False, f"the NVIDIA driver library {DRIVER_LIBRARY} was not found ({exc})",
                           "install the NVIDIA driver, or run on a machine with an NVIDIA GPU")
    rc = int(lib.cuInit(0))
    if rc == _CUDA_ERROR_NO_DEVICE and hidden:
        return ProbeResult(False, hidden, unhide)
    if rc == _CUDA_ERROR_NO_DEVICE:
        return ProbeResult(False, "the NVIDIA driver found no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)",
                           "run on a machine with an NVIDIA GPU")
    if rc == _CUDA_ERROR_STUB_LIBRARY:
        return ProbeResult(False, f"{DRIVER_LIBRARY} is the toolkit's stub library, not a driver",
                           "install the NVIDIA driver")
    if rc in (_CUDA_ERROR_INSUFFICIENT_DRIVER, _CUDA_ERROR_SYSTEM_DRIVER_MISMATCH):
        return ProbeResult(False, f"the NVIDIA driver is not usable (cuInit returned CUresult {rc}: "
                           "kernel module and user library differ, or the driver is too old)",
                           "reinstall or upgrade the NVIDIA driver")
    if rc != _CUDA_SUCCESS:
        return ProbeResult(False, f"cuInit failed with CUresult {rc}", "check `nvidia-smi` and the driver install")
    count = ctypes.c_int(0)
    rc = int(lib.cuDeviceGetCount(ctypes.byref(count)))
    if rc != _CUDA_SUCCESS:
        return ProbeResult(False, f"cuDeviceGetCount failed with CUresult {rc}",
                           "check `nvidia-smi` and the driver install")
    if count.value < 1:
        if hidden or visible is not None:
            why = hidden or f"CUDA_VISIBLE_DEVICES={visible!r} names no existing GPU"
            return ProbeResult(False, why, unhide)
        return ProbeResult(False, "the NVIDIA driver reports no CUDA device", "run on a machine with an NVIDIA GPU")
    version = ctypes.c_int(0)
    rc = int(lib.cuDriverGetVersion(ctypes.byref(version)))
    driver = version.value if rc == _CUDA_SUCCESS else 0
    if find_spec("cupy") is None:
        return ProbeResult(False, "CuPy is not installed", PIP_INSTALL,
                           device_count=count.value, driver_version=driver)
    try:
        cupy = import_cupy() if import_cupy is not None else importlib.import_module("cupy")
        runtime = int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception as exc:  # a broken CuPy install must be a reason, not a crash
        return ProbeResult(False, f"CuPy failed to import: {type(exc).__name__}: {exc}",
                           f"reinstall CuPy: {PIP_INSTALL}", device_count=count.value, driver_version=driver)
    if driver and driver // 1000 < runtime // 1000:
        return ProbeResult(
            False,
            f"the NVIDIA driver supports CUDA {_version_text(driver)}, older than CuPy's CUDA runtime "
            f"{_version_text(runtime)} (driver too old)",
            f"upgrade the NVIDIA driver, or install the CuPy build for CUDA {driver // 1000} "
            f"(pip install cupy-cuda{driver // 1000}x)",
            device_count=count.value, driver_version=driver, runtime_version=runtime,
        )
    return ProbeResult(True, device_count=count.value, driver_version=driver, runtime_version=runtime)
