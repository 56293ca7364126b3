"""DeviceCapabilities as data; saved GPU profiles; launch configs and grids checked against them."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import numpy as np
import pytest
from pydantic import ValidationError

import hal_core
from hal_core import DeviceCapabilities, LaunchConfig, LaunchConfigError, grid_for, load_profile, profile_names

H200, RTX4060, MI300X = "H200", "RTX 4060", "MI300X"


@pytest.mark.parametrize("name", profile_names())
def test_every_saved_profile_loads_and_round_trips_json(name: str) -> None:
    """Each shipped profile loads, validates and survives a JSON round trip unchanged."""
    caps = load_profile(name)
    assert caps.name == name
    assert caps.compute_units > 0 and caps.memory_total > 0
    assert DeviceCapabilities.from_json(caps.to_json()) == caps


def test_profiles_cover_both_vendors() -> None:
    """The shipped profiles include NVIDIA and AMD GPUs (warp 32 and wavefront 64)."""
    caps = [load_profile(n) for n in profile_names()]
    assert {c.vendor for c in caps} >= {"nvidia", "amd"}
    assert {c.simd_width for c in caps} >= {32, 64}


def test_profile_lookup_by_unique_substring_and_error() -> None:
    """load_profile matches a unique case-insensitive substring and otherwise names the choices."""
    assert "H200" in load_profile("h200").name
    with pytest.raises(LookupError, match="choose one of"):
        load_profile("no such gpu")


def test_capabilities_are_frozen_and_validated() -> None:
    """Capabilities reject unknown dtypes and fields, and cannot be changed after creation."""
    caps = load_profile(H200)
    with pytest.raises(ValidationError):
        caps.compute_units = 1  # type: ignore[misc]
    data = caps.model_dump()
    with pytest.raises(ValidationError, match="unknown dtype"):
        DeviceCapabilities(**{**data, "dtypes": {"fp32", "fp13"}})
    with pytest.raises(ValidationError):
        DeviceCapabilities(**{**data, "warp_size": 32})
    assert caps.supports_dtype("bf16") and caps.has("tensor_cores")


def test_optin_shared_memory_defaults_to_static() -> None:
    """shared_mem_per_block_optin of 0 reads as shared_mem_per_block."""
    data = load_profile(H200).model_dump()
    caps = DeviceCapabilities(**{**data, "shared_mem_per_block_optin": 0})
    assert caps.shared_mem_per_block_optin == caps.shared_mem_per_block


def test_launch_config_is_frozen_hashable_and_normalised() -> None:
    """LaunchConfig stores 3-tuples, is hashable and equal by value, and cannot be changed."""
    config = LaunchConfig(grid=128, block=(256,), shared_mem=1024)
    assert config.grid == (128, 1, 1) and config.block == (256, 1, 1)
    assert {config, LaunchConfig((128, 1, 1), (256, 1, 1), 1024)} == {config}
    assert config.threads_per_block == 256 and config.num_blocks == 128
    with pytest.raises(AttributeError):
        config.grid = (1, 1, 1)  # type: ignore[misc]
    assert dataclasses.replace(config, block=(16, 16)).block == (16, 16, 1)


@pytest.mark.parametrize(
    ("grid", "block", "shared_mem"),
    [(0, 1, 0), ((1, 2, 3, 4), 1, 0), (1, (32, -1), 0), (1, 32, -5), (1.5, 32, 0), (True, 32, 0),
     (1, (32, False), 0), (1, 32, True)],
    ids=["zero-grid", "four-dims", "negative-block", "negative-smem", "float-grid", "bool-grid", "bool-block",
         "bool-smem"],
)
def test_launch_config_rejects_malformed_values(grid, block, shared_mem) -> None:
    """Malformed grids, blocks or shared memory raise LaunchConfigError at construction."""
    with pytest.raises(LaunchConfigError):
        LaunchConfig(grid=grid, block=block, shared_mem=shared_mem)


@pytest.mark.parametrize(
    ("profile", "config", "limit"),
    [
        (H200, LaunchConfig(1, 2048), "max_threads_per_block"),
        (RTX4060, LaunchConfig(1, (1, 1, 128)), "max_block_dims[2]"),
        (MI300X, LaunchConfig((1, 70000, 1), 64), "max_grid_dims[1]"),
        (H200, LaunchConfig(1, 128, shared_mem=10**6), "shared_mem_per_block_optin"),
        (MI300X, LaunchConfig(1, 64, shared_mem=65537), "shared_mem_per_block_optin"),
    ],
    ids=["h200-threads", "rtx4060-block-z", "mi300x-grid-y", "h200-smem", "mi300x-smem"],
)
def test_launch_config_validate_names_the_limit(profile: str, config: LaunchConfig, limit: str) -> None:
    """validate() raises LaunchConfigError naming the device limit and the device."""
    caps = load_profile(profile)
    with pytest.raises(LaunchConfigError) as info:
        config.validate(caps)
    assert limit in str(info.value) and caps.name in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("profile", [H200, RTX4060, MI300X])
def test_launch_config_within_limits_passes(profile: str) -> None:
    """A config at the device's limits validates."""
    caps = load_profile(profile)
    LaunchConfig(caps.max_grid_dims[0], caps.max_threads_per_block, caps.shared_mem_per_block_optin).validate(caps)


@pytest.mark.parametrize("profile", [H200, RTX4060, MI300X])
def test_grid_for_is_derived_from_compute_units(profile: str) -> None:
    """grid_for covers small work exactly and caps large work at enough blocks to fill every compute unit."""
    caps = load_profile(profile)
    assert grid_for(caps, 0, 256) == 0
    assert grid_for(caps, 1000, 256) == 4
    resident = caps.max_threads_per_cu // 256
    assert grid_for(caps, 10**9, 256) == caps.compute_units * resident
    assert grid_for(caps, 10**9, 256, blocks_per_cu=1) == caps.compute_units
    with pytest.raises(LaunchConfigError, match="threads_per_block"):
        grid_for(caps, 10, caps.max_threads_per_block + 1)


def test_profiles_differ_where_hardware_does() -> None:
    """Different GPUs give different grids for the same work (no hard-coded constants)."""
    grids = {name: grid_for(load_profile(name), 10**9, 256) for name in (H200, RTX4060, MI300X)}
    assert len(set(grids.values())) == 3
    assert hal_core.load_profile(H200).compute_units == 132


BAD_FIELDS = [
    ("compute_units", 0, "compute_units"),
    ("compute_units", -4, "compute_units"),
    ("compute_units", True, "compute_units"),
    ("simd_width", 0, "simd_width"),
    ("max_threads_per_block", 10**9, "max_threads_per_block"),
    ("max_block_dims", [1024, 0, 64], "max_block_dims"),
    ("max_grid_dims", [-1, 65535, 65535], "max_grid_dims"),
    ("max_grid_dims", [2**40, 65535, 65535], "max_grid_dims"),
    ("shared_mem_per_block", -1, "shared_mem_per_block"),
    ("l2_bytes", 10**30, "l2_bytes"),
    ("memory_total", 0, "memory_total"),
    ("memory_total", 10**30, "memory_total"),
    ("memory_free", 2 * 150109945856, "memory_free"),
    ("memory_bandwidth_gbps", float("nan"), "memory_bandwidth_gbps"),
    ("memory_bandwidth_gbps", float("inf"), "memory_bandwidth_gbps"),
    ("peak_fp16_tflops", -1.0, "peak_fp16_tflops"),
    ("allocation_granularity", 0, "allocation_granularity"),
    ("name", "", "name"),
    ("max_threads_per_cu", 512, "max_threads_per_cu"),
    ("shared_mem_per_block_optin", 1024, "shared_mem_per_block_optin"),
]


@pytest.mark.parametrize(("field", "value", "named"), BAD_FIELDS,
                         ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_FIELDS])
def test_capabilities_refuse_impossible_values(field: str, value: object, named: str) -> None:
    """Zero, negative, bool or absurd counts and sizes, and free > total memory, are refused naming the field."""
    data = load_profile(H200).model_dump(mode="json")
    data[field] = value
    with pytest.raises(ValidationError, match=named):
        DeviceCapabilities(**data)
    text = json.dumps({**data, field: value}, allow_nan=True)
    with pytest.raises(ValidationError, match=named):
        DeviceCapabilities.from_json(text)


def test_capabilities_accept_what_real_devices_report() -> None:
    """The bounds leave room: free == total, huge host memory, numpy integers, the CPU backend's own values."""
    data = load_profile(H200).model_dump()
    caps = DeviceCapabilities(**{**data, "memory_free": data["memory_total"]})
    assert caps.memory_free == caps.memory_total
    big = DeviceCapabilities(**{**data, "memory_total": 64 << 40, "compute_units": np.int64(384)})
    assert big.compute_units == 384 and type(big.compute_units) is int
    cpu_caps = hal_core.get_backend("cpu").device(0).capabilities
    assert DeviceCapabilities.from_json(cpu_caps.to_json()) == cpu_caps


def test_every_shared_device_profile_loads() -> None:
    """The raw profiles hal-core ships are those of the shared profile collection, and each validates."""
    shipped = json.loads(resources.files("hal_core.profiles").joinpath("device-profiles.json").read_text())
    assert {entry["name"] for entry in shipped} == set(profile_names())
    for entry in shipped:
        caps = load_profile(entry["name"])
        assert caps.memory_total == entry["memory_bytes"] and caps.max_grid_dims == tuple(entry["max_grid_dims"])
