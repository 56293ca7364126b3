"""The pure mapping from ``hipDeviceProp_t`` fields to DeviceCapabilities, against saved AMD profiles."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
from hal_rocm._capabilities import arch_of, capabilities_from_properties, dtypes_for

import hal_core

AMD_PROFILES = ("AMD Instinct MI300X", "AMD Instinct MI250X", "Radeon RX 7900 XTX")
PROFILE_IDS = ("MI300X", "MI250X", "RX7900XTX")
#: gcnArchName as the HIP runtime reports it (with the target-feature suffix on CDNA).
_GCN = {"gfx942": "gfx942:sramecc+:xnack-", "gfx90a": "gfx90a:sramecc+:xnack-", "gfx1100": "gfx1100"}


def _raw(name: str) -> dict[str, Any]:
    text = resources.files("hal_core.profiles").joinpath("device-profiles.json").read_text()
    return next(e for e in json.loads(text) if e["name"] == name)


def props_from_profile(name: str) -> dict[str, Any]:
    """What CuPy's ROCm build would return from ``getDeviceProperties``, HIP's own field meanings included."""
    e = _raw(name)
    return {
        "name": e["name"].encode(), "gcnArchName": _GCN[e["arch"]].encode(),
        "multiProcessorCount": e["compute_units"], "warpSize": e["simd_width"],
        "maxThreadsPerBlock": e["max_threads_per_block"], "maxThreadsPerMultiProcessor": e["max_threads_per_cu"],
        "maxThreadsDim": tuple(e["max_block_dims"]), "maxGridSize": tuple(e["max_grid_dims"]),
        "sharedMemPerBlock": e["shared_mem_per_block"],
        "sharedMemPerBlockOptin": 0,  # ROCm <= 6.2 reports 0: "same as sharedMemPerBlock"
        # HIP's sharedMemPerMultiprocessor is LDS per CU x CU count; the per-CU value has another name.
        "sharedMemPerMultiprocessor": e["shared_mem_per_cu"] * e["compute_units"],
        "maxSharedMemoryPerMultiProcessor": e["shared_mem_per_cu"],
        "regsPerBlock": e["regs_per_block"], "regsPerMultiprocessor": e["regs_per_cu"],
        "l2CacheSize": e["l2_bytes"], "totalGlobalMem": e["memory_bytes"], "managedMemory": 1,
        "memoryPoolsSupported": 1, "integrated": 0,
    }


FIELDS = ("vendor", "name", "arch", "compute_units", "simd_width", "max_threads_per_block", "max_threads_per_cu",
          "max_block_dims", "max_grid_dims", "shared_mem_per_block", "shared_mem_per_block_optin",
          "shared_mem_per_cu", "registers_per_block", "registers_per_cu", "l2_bytes", "memory_total", "dtypes")


@pytest.mark.parametrize("name", AMD_PROFILES, ids=PROFILE_IDS)
def test_mapping_matches_profile(name: str) -> None:
    """Every field launch configs and kernel choice use equals the saved profile's."""
    caps = capabilities_from_properties(props_from_profile(name), memory_free=1 << 30)
    profile = hal_core.load_profile(name)
    for field in FIELDS:
        assert getattr(caps, field) == getattr(profile, field), field
    assert caps.memory_free == 1 << 30 and caps.has("tensor_cores")
    assert caps.has("async_alloc") and caps.has("managed_memory")


def test_wavefront_and_wgp_mode() -> None:
    """CDNA runs 64 lanes; RDNA3 under HIP runs wave32 and counts WGPs (48 on a 7900 XTX) as multiprocessors."""
    assert capabilities_from_properties(props_from_profile("AMD Instinct MI300X")).simd_width == 64
    rdna = capabilities_from_properties(props_from_profile("Radeon RX 7900 XTX"))
    assert (rdna.simd_width, rdna.compute_units) == (32, 48)


def test_bandwidth_from_clocks_except_hbm3() -> None:
    """MI250X: 1.6 GHz x 2 x 4096 bit = 1638.4 GB/s; MI300X's reported clock would give half, so it stays unknown."""
    mi250 = {**props_from_profile("AMD Instinct MI250X"), "memoryClockRate": 1_600_000, "memoryBusWidth": 4096}
    assert capabilities_from_properties(mi250).memory_bandwidth_gbps == pytest.approx(1638.4)
    mi300 = {**props_from_profile("AMD Instinct MI300X"), "memoryClockRate": 1_300_000, "memoryBusWidth": 8192}
    assert capabilities_from_properties(mi300).memory_bandwidth_gbps is None


def test_arch_of_strips_target_features() -> None:
    assert arch_of(b"gfx942:sramecc+:xnack-\0") == "gfx942" and arch_of("gfx1100") == "gfx1100"


@pytest.mark.parametrize(("arch", "present", "absent"), [
    ("gfx90a", {"fp64", "bf16", "int8"}, {"fp8_e4m3fnuz", "fp8_e4m3"}),
    ("gfx942", {"fp8_e4m3fnuz", "fp8_e5m2fnuz", "int8"}, {"fp8_e4m3"}),
    ("gfx950", {"fp8_e4m3", "fp8_e5m2"}, {"fp8_e4m3fnuz"}),
    ("gfx1100", {"fp16", "bf16", "int8", "int4"}, {"fp64", "fp8_e4m3"}),
    ("gfx1201", {"fp8_e4m3", "int8"}, {"fp64"}),
], ids=["cdna2", "cdna3", "cdna4", "rdna3", "rdna4"])
def test_dtypes_by_arch(arch: str, present: set[str], absent: set[str]) -> None:
    """FP8 only in FNUZ form on CDNA3, OCP FP8 on CDNA4 and RDNA4; no fp64 matrix on RDNA."""
    names = dtypes_for(arch)
    assert present <= names and not (absent & names)


def test_no_warp_matrix_instructions() -> None:
    """The HIP prelude provides no mma.sync spellings: the tensor-core sources are never selected or built."""
    from hal_rocm import ROCM

    for name in ("AMD Instinct MI300X", "AMD Instinct MI250X"):
        assert ROCM.warp_mma_level(hal_core.load_profile(name)) == 0
