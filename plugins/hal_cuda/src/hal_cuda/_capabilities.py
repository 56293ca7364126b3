"""CUDA device properties to :class:`hal_core.DeviceCapabilities`, as a pure function.

:func:`capabilities_from_properties` takes the dict that
``cupy.cuda.runtime.getDeviceProperties(i)`` returns (``cudaDeviceProp``
field names) plus a few ``cudaDeviceGetAttribute`` values, and needs no
GPU: tests feed it dicts built from saved profiles.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hal_cupy import ddr_bandwidth_gbps, property_text

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["ATTRIBUTE_FIELDS", "ATTRIBUTE_NAMES", "capabilities_from_properties", "dtypes_for", "features_for"]

#: ``cudaDevAttr*`` names read besides the properties (CUDA 13 dropped the clocks from ``cudaDeviceProp``),
#: with the ``cudaDeviceProp`` field each one stands for.
ATTRIBUTE_FIELDS = {
    "MemoryPoolsSupported": "memoryPoolsSupported",
    "ManagedMemory": "managedMemory",
    "PageableMemoryAccess": "pageableMemoryAccess",
    "MemoryClockRate": "memoryClockRate",
    "GlobalMemoryBusWidth": "memoryBusWidth",
}
ATTRIBUTE_NAMES = tuple(ATTRIBUTE_FIELDS)

_FP8 = {"fp8_e4m3", "fp8_e5m2"}


def dtypes_for(major: int, minor: int) -> frozenset[str]:
    """Dtypes a device of compute capability ``major.minor`` computes with tensor cores, plus fp32.

    By the CUDA Programming Guide's tensor-core table: fp16 from sm_70,
    int8/int4 from sm_72/75, bf16/tf32 from sm_80 (fp64 on the datacenter
    parts sm_80/90/100), fp8 from sm_89, fp6/fp4 from sm_100; int4 dropped
    from sm_90 on.
    """
    cc = (major, minor)
    names = {"fp32"}
    if cc >= (7, 0):
        names.add("fp16")
    if cc >= (7, 2):
        names.add("int8")
    if (7, 2) <= cc < (9, 0):
        names.add("int4")
    if cc >= (8, 0):
        names |= {"bf16", "tf32"}
    if cc in ((8, 0), (9, 0), (10, 0), (10, 3)):
        names.add("fp64")
    if cc >= (8, 9):
        names |= _FP8
    if cc >= (10, 0):
        names |= {"fp6", "fp4_e2m1"}
    return frozenset(names)


def features_for(major: int, props: Mapping[str, Any]) -> frozenset[str]:
    """Feature flags: tensor cores from sm_70, ``int8_dot`` from sm_80 (the int8 ``mma.sync`` shape hal's W4A8 and
    W8A8 kernels use); async alloc, managed and unified memory as the device reports."""
    flags = set()
    if major >= 7:
        flags.add("tensor_cores")
    if major >= 8:
        flags.add("int8_dot")
    if props.get("memoryPoolsSupported"):
        flags.add("async_alloc")
    if props.get("managedMemory"):
        flags.add("managed_memory")
    if props.get("pageableMemoryAccess") or props.get("integrated"):
        flags.add("unified_memory")
    return frozenset(flags)


def capabilities_from_properties(
    props: Mapping[str, Any],
    attributes: Mapping[str, Any] | None = None,
    *,
    memory_free: int | None = None,
) -> DeviceCapabilities:
    """The capabilities of one CUDA device.

    ``props``: ``cudaDeviceProp`` fields by name (CuPy's ``getDeviceProperties``);
    ``attributes``: ``cudaDevAttr*`` values by name without the prefix
    (:data:`ATTRIBUTE_NAMES`), which win over ``props``; ``memory_free``:
    bytes free now (``cudaMemGetInfo``).
    """
    from hal_core import DeviceCapabilities  # imported on first use: pydantic is slow to import

    merged = {**props, **{ATTRIBUTE_FIELDS.get(k, k): v for k, v in (attributes or {}).items()}}
    major, minor = int(merged["major"]), int(merged["minor"])
    shared_block = int(merged["sharedMemPerBlock"])
    return DeviceCapabilities(
        vendor="nvidia",
        name=property_text(merged["name"]),
        arch=f"sm_{major}{minor}",
        compute_units=int(merged["multiProcessorCount"]),
        simd_width=int(merged["warpSize"]),
        max_threads_per_block=int(merged["maxThreadsPerBlock"]),
        max_threads_per_cu=int(merged["maxThreadsPerMultiProcessor"]),
        max_block_dims=tuple(int(d) for d in merged["maxThreadsDim"]),
        max_grid_dims=tuple(int(d) for d in merged["maxGridSize"]),
        shared_mem_per_block=shared_block,
        shared_mem_per_block_optin=int(merged.get("sharedMemPerBlockOptin") or shared_block),
        shared_mem_per_cu=int(merged.get("sharedMemPerMultiprocessor") or 0),
        registers_per_block=int(merged["regsPerBlock"]),
        registers_per_cu=int(merged.get("regsPerMultiprocessor") or 0),
        l2_bytes=int(merged.get("l2CacheSize") or 0),
        memory_total=int(merged["totalGlobalMem"]),
        memory_free=None if memory_free is None else int(memory_free),
        memory_bandwidth_gbps=ddr_bandwidth_gbps(merged),
        dtypes=dtypes_for(major, minor),
        features=features_for(major, merged),
        allocation_granularity=512,  # CuPy's pools round every allocation to 512 bytes
    )
