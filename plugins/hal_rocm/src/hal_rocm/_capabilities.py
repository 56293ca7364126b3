"""HIP device properties to :class:`hal_core.DeviceCapabilities`, as a pure function.

:func:`capabilities_from_properties` takes the dict that CuPy's ROCm build
returns from ``getDeviceProperties(i)`` (``hipDeviceProp_t`` field names)
and needs no GPU: tests feed it dicts built from saved profiles. Several
HIP fields mean something else than their CUDA namesakes (see
``device-profiles/README.md``):

- ``sharedMemPerMultiprocessor`` is LDS per CU times the CU count on ROCm >= 6;
  the per-CU LDS is ``maxSharedMemoryPerMultiProcessor``.
- ``sharedMemPerBlockOptin`` is 0 on ROCm <= 6.2: read as "same as
  ``sharedMemPerBlock``" (there is no opt-in beyond 64 KiB on these parts).
- ``multiProcessorCount`` counts WGPs on RDNA (wave32, WGP mode), CUs on CDNA.
- ``memoryClockRate`` x bus width gives half the real bandwidth on MI300X
  (HBM3); the bandwidth is left unknown on gfx94x/gfx95x rather than wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hal_cupy import ddr_bandwidth_gbps, property_text

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["arch_of", "capabilities_from_properties", "dtypes_for", "features_for"]

_CDNA2 = ("gfx90a",)
_CDNA3 = ("gfx940", "gfx941", "gfx942")
_CDNA4 = ("gfx950",)


def arch_of(gcn_arch_name: Any) -> str:
    """``'gfx942'`` from ``'gfx942:sramecc+:xnack-'`` (bytes or str)."""
    text = gcn_arch_name.decode(errors="replace") if isinstance(gcn_arch_name, bytes) else str(gcn_arch_name)
    return text.rstrip("\0").split(":")[0].strip()


def dtypes_for(arch: str) -> frozenset[str]:
    """Dtypes the matrix units (MFMA on CDNA, WMMA on RDNA) compute, plus fp32 (every device computes it).

    CDNA2 (gfx90a): fp64, fp32, fp16, bf16, int8. CDNA3 (gfx94x): also FP8 in
    the FNUZ encodings only. CDNA4 (gfx950): OCP FP8 as well. RDNA3 (gfx11):
    WMMA fp16, bf16, iu8, iu4. RDNA4 (gfx12): adds OCP FP8.
    """
    if arch in _CDNA2:
        return frozenset({"fp64", "fp32", "fp16", "bf16", "int8"})
    if arch in _CDNA3:
        return frozenset({"fp64", "fp32", "fp16", "bf16", "int8", "fp8_e4m3fnuz", "fp8_e5m2fnuz"})
    if arch in _CDNA4:
        return frozenset({"fp64", "fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"})
    if arch.startswith("gfx11"):
        return frozenset({"fp32", "fp16", "bf16", "int8", "int4"})
    if arch.startswith("gfx12"):
        return frozenset({"fp32", "fp16", "bf16", "int8", "int4", "fp8_e4m3", "fp8_e5m2"})
    return frozenset({"fp32"})


def features_for(arch: str, props: Mapping[str, Any]) -> frozenset[str]:
    """Matrix units on CDNA2+ and RDNA3+; async alloc, managed and unified memory as the device reports."""
    flags = set()
    if arch in (*_CDNA2, *_CDNA3, *_CDNA4) or arch.startswith(("gfx11", "gfx12")):
        flags.add("tensor_cores")
    if props.get("memoryPoolsSupported"):
        flags.add("async_alloc")
    if props.get("managedMemory"):
        flags.add("managed_memory")
    if props.get("integrated"):
        flags.add("unified_memory")
    return frozenset(flags)


def _bandwidth_gbps(arch: str, props: Mapping[str, Any]) -> float | None:
    """The DDR formula, except on CDNA3/4 (HBM3 parts whose reported clock does not give the bandwidth)."""
    return None if arch in (*_CDNA3, *_CDNA4) else ddr_bandwidth_gbps(props)


def capabilities_from_properties(
    props: Mapping[str, Any],
    attributes: Mapping[str, Any] | None = None,
    *,
    memory_free: int | None = None,
) -> DeviceCapabilities:
    """The capabilities of one AMD device from ``hipDeviceProp_t`` fields by name (``attributes`` win)."""
    from hal_core import DeviceCapabilities  # imported on first use: pydantic is slow to import

    merged = {**props, **(attributes or {})}
    arch = arch_of(merged["gcnArchName"])
    shared_block = int(merged["sharedMemPerBlock"])
    per_cu_lds = merged.get("maxSharedMemoryPerMultiProcessor") or shared_block
    return DeviceCapabilities(
        vendor="amd",
        name=property_text(merged["name"]),
        arch=arch,
        compute_units=int(merged["multiProcessorCount"]),
        simd_width=int(merged["warpSize"]),
        max_threads_per_block=int(merged["maxThreadsPerBlock"]),
        max_threads_per_cu=int(merged["maxThreadsPerMultiProcessor"]),
        max_block_dims=tuple(int(d) for d in merged["maxThreadsDim"]),
        max_grid_dims=tuple(int(d) for d in merged["maxGridSize"]),
        shared_mem_per_block=shared_block,
        shared_mem_per_block_optin=int(merged.get("sharedMemPerBlockOptin") or shared_block),
        shared_mem_per_cu=int(per_cu_lds),
        registers_per_block=int(merged["regsPerBlock"]),
        registers_per_cu=int(merged.get("regsPerMultiprocessor") or merged["regsPerBlock"]),
        l2_bytes=int(merged.get("l2CacheSize") or 0),
        memory_total=int(merged["totalGlobalMem"]),
        memory_free=None if memory_free is None else int(memory_free),
        memory_bandwidth_gbps=_bandwidth_gbps(arch, merged),
        dtypes=dtypes_for(arch),
        features=features_for(arch, merged),
        allocation_granularity=512,  # CuPy's pools round every allocation to 512 bytes (ROCm builds too)
    )
