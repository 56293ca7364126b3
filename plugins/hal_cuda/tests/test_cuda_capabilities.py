"""The pure mapping from ``cudaDeviceProp`` fields to DeviceCapabilities, against saved GPU profiles."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
from hal_cuda._capabilities import capabilities_from_properties, dtypes_for
from nvidia_profiles import NVIDIA_PROFILES, PROFILE_IDS

import hal_core

#: (major, minor) of each profile's arch.
_CC = {"sm_90": (9, 0), "sm_80": (8, 0), "sm_89": (8, 9), "sm_120": (12, 0)}


def _raw(name: str) -> dict[str, Any]:
    text = resources.files("hal_core.profiles").joinpath("device-profiles.json").read_text()
    return next(e for e in json.loads(text) if e["name"] == name)


def props_from_profile(name: str) -> dict[str, Any]:
    """What ``cupy.cuda.runtime.getDeviceProperties`` would return for this device (the fields used)."""
    e = _raw(name)
    major, minor = _CC[e["arch"]]
    return {
        "name": e["name"].encode(), "major": major, "minor": minor,
        "multiProcessorCount": e["compute_units"], "warpSize": e["simd_width"],
        "maxThreadsPerBlock": e["max_threads_per_block"], "maxThreadsPerMultiProcessor": e["max_threads_per_cu"],
        "maxThreadsDim": tuple(e["max_block_dims"]), "maxGridSize": tuple(e["max_grid_dims"]),
        "sharedMemPerBlock": e["shared_mem_per_block"], "sharedMemPerBlockOptin": e["shared_mem_per_block_optin"],
        "sharedMemPerMultiprocessor": e["shared_mem_per_cu"], "regsPerBlock": e["regs_per_block"],
        "regsPerMultiprocessor": e["regs_per_cu"], "l2CacheSize": e["l2_bytes"],
        "totalGlobalMem": e["memory_bytes"], "managedMemory": 1, "memoryPoolsSupported": 1,
        "pageableMemoryAccess": 0, "integrated": 0,
    }


FIELDS = ("vendor", "name", "arch", "compute_units", "simd_width", "max_threads_per_block", "max_threads_per_cu",
          "max_block_dims", "max_grid_dims", "shared_mem_per_block", "shared_mem_per_block_optin",
          "shared_mem_per_cu", "registers_per_block", "registers_per_cu", "l2_bytes", "memory_total", "dtypes",
          "features", "allocation_granularity")


@pytest.mark.parametrize("name", NVIDIA_PROFILES, ids=PROFILE_IDS)
def test_mapping_matches_profile(name: str) -> None:
    """Every field launch configs and kernel choice use equals the saved profile's."""
    caps = capabilities_from_properties(props_from_profile(name), memory_free=1 << 30)
    profile = hal_core.load_profile(name)
    for field in FIELDS:
        assert getattr(caps, field) == getattr(profile, field), field
    assert caps.memory_free == 1 << 30


def test_attributes_win_and_give_bandwidth() -> None:
    """cudaDevAttr values override the props; memory clock x bus width gives the bandwidth (H100: ~3352 GB/s)."""
    props = props_from_profile("NVIDIA H100 80GB HBM3")
    caps = capabilities_from_properties(props, {"MemoryPoolsSupported": 0, "MemoryClockRate": 2619000,
                                                "GlobalMemoryBusWidth": 5120})
    assert not caps.has("async_alloc")
    assert caps.memory_bandwidth_gbps == pytest.approx(3352.3, rel=1e-3)


def test_optin_zero_reads_as_static() -> None:
    """A zero opt-in limit means 'same as sharedMemPerBlock'."""
    props = {**props_from_profile("NVIDIA A100-SXM4-80GB"), "sharedMemPerBlockOptin": 0}
    assert capabilities_from_properties(props).shared_mem_per_block_optin == 49152


def test_features_by_device() -> None:
    """No tensor cores before sm_70; managed/unified memory as reported."""
    props = {**props_from_profile("NVIDIA A100-SXM4-80GB"), "major": 6, "minor": 1, "managedMemory": 0,
             "integrated": 1}
    caps = capabilities_from_properties(props)
    assert not caps.has("tensor_cores") and not caps.has("managed_memory") and caps.has("unified_memory")
    assert caps.arch == "sm_61"


@pytest.mark.parametrize(("cc", "present", "absent"), [
    ((7, 0), {"fp16"}, {"bf16", "int8", "fp8_e4m3"}),
    ((7, 5), {"fp16", "int8", "int4"}, {"bf16"}),
    ((8, 6), {"bf16", "tf32", "int4"}, {"fp64", "fp8_e4m3"}),
    ((8, 9), {"fp8_e4m3", "fp8_e5m2", "int4"}, {"fp64"}),
    ((9, 0), {"fp8_e4m3", "fp64", "int8"}, {"int4", "fp4_e2m1"}),
    ((10, 0), {"fp4_e2m1", "fp6", "fp64"}, {"int4"}),
], ids=["sm70", "sm75", "sm86", "sm89", "sm90", "sm100"])
def test_dtypes_by_compute_capability(cc: tuple[int, int], present: set[str], absent: set[str]) -> None:
    """bf16 from sm_80, fp8 from sm_89, int8 from sm_72; fp32 always."""
    names = dtypes_for(*cc)
    assert present <= names and not (absent & names) and "fp32" in names


@pytest.mark.parametrize(("arch", "level"), [("sm_75", 75), ("sm_80", 80), ("sm_90a", 90), ("sm_100a", 100),
                                             ("sm_120f", 120), ("gfx942", 0)])
def test_warp_mma_level_from_arch(arch: str, level: int) -> None:
    """The level of the warp matrix instructions is the compute capability of the arch name."""
    from hal_cuda._platform import CUDA

    caps = hal_core.load_profile("NVIDIA A100-SXM4-80GB").model_copy(update={"arch": arch})
    assert CUDA.warp_mma_level(caps) == level


@pytest.mark.parametrize(("major", "minor", "expected"), [(6, 1, False), (7, 5, False), (8, 0, True), (9, 0, True)])
def test_int8_dot_from_sm_80(major: int, minor: int, expected: bool) -> None:
    """'int8_dot' (what quantized_gemm's activations='auto' reads) from sm_80, where hal's int8 mma.sync runs."""
    props = {**props_from_profile("NVIDIA A100-SXM4-80GB"), "major": major, "minor": minor}
    assert capabilities_from_properties(props).has("int8_dot") is expected
