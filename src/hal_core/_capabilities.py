"""Device capabilities as plain, validated data (JSON in, JSON out)."""

from __future__ import annotations

import json
from functools import cache
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "DTYPE_NAMES",
    "FEATURE_NAMES",
    "MAX_BYTES",
    "MAX_COUNT",
    "MAX_GRID",
    "MAX_RATE",
    "DeviceCapabilities",
    "load_profile",
    "profile_names",
]

#: Dtype names a device may list in ``DeviceCapabilities.dtypes``.
DTYPE_NAMES = frozenset(
    {"fp64", "fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2",
     "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp6", "fp4_e2m1", "int8", "int4"}
)

#: Feature flags a device may list in ``DeviceCapabilities.features``. ``int8_dot``: the backend's kernels multiply
#: int8 values in hardware dot products summed in int32 on this device (VNNI, AMX-INT8 or AVX2's byte
#: multiply-adds on a CPU, the int8 tensor-core MMA on a GPU), several times their float rate: where integer
#: activations pay (``quantized_gemm``'s ``activations="auto"``).
FEATURE_NAMES = frozenset({"tensor_cores", "unified_memory", "async_alloc", "managed_memory", "int8_dot"})


#: Upper bounds that no real device reaches; a value beyond one is a units mistake or corrupt data.
MAX_COUNT = 1 << 20  # compute units, threads per block, block dimensions
MAX_GRID = 1 << 32  # grid dimensions
MAX_BYTES = 1 << 50  # 1 PiB: memory, caches, shared memory, register files
MAX_RATE = 1e6  # GB/s of bandwidth, TFLOP/s


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError("expected an integer, got a bool")
    return value


Count = Annotated[int, BeforeValidator(_no_bool), Field(gt=0, le=MAX_COUNT)]
GridDim = Annotated[int, BeforeValidator(_no_bool), Field(gt=0, le=MAX_GRID)]
Size = Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=MAX_BYTES)]
Rate = Annotated[float, Field(gt=0, le=MAX_RATE, allow_inf_nan=False)]


class DeviceCapabilities(BaseModel):
    """What one device can do, as explicit numbers instead of magic constants.

    Launch configurations are checked against these fields, and kernels are
    chosen from them. Profiles of real GPUs load with :func:`load_profile`,
    so that logic can be tested without the hardware.

    Every field is validated when the object is made (from Python or JSON),
    raising pydantic's ``ValidationError`` (a ``ValueError``) that names the
    field: counts and dimensions are positive integers (not bools), byte
    sizes non-negative, each below a bound no device reaches
    (:data:`MAX_COUNT`, :data:`MAX_GRID`, :data:`MAX_BYTES`, :data:`MAX_RATE`);
    ``memory_free <= memory_total``, ``max_threads_per_block <= max_threads_per_cu``
    and ``shared_mem_per_block <= shared_mem_per_block_optin``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)  # schema built on first use, not at import

    vendor: str = Field(min_length=1, max_length=64,
                        description="'cpu' for the host, else the device maker's name, as the backend reports it")
    name: str = Field(min_length=1, max_length=256)
    arch: str = Field(min_length=1, max_length=64, description="'sm_90', 'gfx942', 'x86_64-avx512', ...")
    compute_units: Count = Field(description="SMs, CUs or CPU cores")
    simd_width: Count = Field(description="warp 32, wavefront 64, or CPU vector lanes (fp32)")
    max_threads_per_block: Count
    max_threads_per_cu: Count
    max_block_dims: tuple[Count, Count, Count]
    max_grid_dims: tuple[GridDim, GridDim, GridDim]
    shared_mem_per_block: Size = Field(description="bytes usable without opt-in")
    shared_mem_per_block_optin: Size = Field(description="bytes after opt-in; 0 reads as shared_mem_per_block")
    shared_mem_per_cu: Size
    registers_per_block: Size
    registers_per_cu: Size
    l2_bytes: Size
    memory_total: Annotated[int, BeforeValidator(_no_bool), Field(gt=0, le=MAX_BYTES, description="bytes")]
    memory_free: Size | None = Field(default=None, description="bytes, when known at query time")
    memory_bandwidth_gbps: Rate | None = None
    peak_fp16_tflops: Rate | None = None
    dtypes: frozenset[str]
    features: frozenset[str] = frozenset()
    allocation_granularity: Annotated[int, BeforeValidator(_no_bool), Field(gt=0, le=1 << 30)] = Field(
        default=256, description="suggested allocation rounding, bytes")

    @field_validator("dtypes")
    @classmethod
    def _known_dtypes(cls, value: frozenset[str]) -> frozenset[str]:
        unknown = set(value) - DTYPE_NAMES
        if unknown:
            raise ValueError(f"unknown dtype names {sorted(unknown)}; known: {sorted(DTYPE_NAMES)}")
        return value

    @field_validator("features")
    @classmethod
    def _known_features(cls, value: frozenset[str]) -> frozenset[str]:
        unknown = set(value) - FEATURE_NAMES
        if unknown:
            raise ValueError(f"unknown feature flags {sorted(unknown)}; known: {sorted(FEATURE_NAMES)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> DeviceCapabilities:
        if self.shared_mem_per_block_optin == 0:
            object.__setattr__(self, "shared_mem_per_block_optin", self.shared_mem_per_block)
        if self.memory_free is not None and self.memory_free > self.memory_total:
            raise ValueError(f"memory_free ({self.memory_free} bytes) exceeds memory_total ({self.memory_total} bytes)")
        if self.max_threads_per_block > self.max_threads_per_cu:
            raise ValueError(f"max_threads_per_block ({self.max_threads_per_block}) exceeds max_threads_per_cu "
                             f"({self.max_threads_per_cu}): a block runs on one compute unit")
        if self.shared_mem_per_block > self.shared_mem_per_block_optin:
            raise ValueError(f"shared_mem_per_block ({self.shared_mem_per_block}) exceeds shared_mem_per_block_optin "
                             f"({self.shared_mem_per_block_optin}); opting in never gives less")
        return self

    def supports_dtype(self, name: str) -> bool:
        """Whether ``name`` (e.g. ``'bf16'``) is in :attr:`dtypes`."""
        return name in self.dtypes

    def has(self, feature: str) -> bool:
        """Whether ``feature`` (e.g. ``'tensor_cores'``) is in :attr:`features`."""
        return feature in self.features

    def to_json(self) -> str:
        """Serialise to JSON; :meth:`from_json` reads it back equal."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> DeviceCapabilities:
        """Parse JSON written by :meth:`to_json`."""
        return cls.model_validate_json(text)


@cache
def _raw_profiles() -> dict[str, dict[str, Any]]:
    from importlib import resources

    text = resources.files("hal_core.profiles").joinpath("device-profiles.json").read_text()
    return {entry["name"]: entry for entry in json.loads(text)}


def profile_names() -> list[str]:
    """Names of the saved GPU capability profiles shipped with hal-core."""
    return sorted(_raw_profiles())


def load_profile(name: str) -> DeviceCapabilities:
    """Capabilities of a real GPU from its saved profile, e.g. ``'NVIDIA H200'``.

    Matches the exact name first, then a unique case-insensitive substring
    (``'h200'``, ``'mi300x'``). Raises ``LookupError`` naming the choices.
    """
    profiles = _raw_profiles()
    entry = profiles.get(name)
    if entry is None:
        matches = [key for key in profiles if name.lower() in key.lower()]
        if len(matches) != 1:
            raise LookupError(
                f"no unique device profile matches {name!r}; choose one of {profile_names()}"
            )
        entry = profiles[matches[0]]
    features = {"tensor_cores"} if entry.get("peak_fp16_tensor_tflops") else set()
    features |= set(entry.get("features", ()))  # flags no other field implies (int8_dot)
    dtypes = set(entry["dtypes"]) | {"fp32"}
    return DeviceCapabilities(
        vendor=entry["vendor"],
        name=entry["name"],
        arch=entry["arch"],
        compute_units=entry["compute_units"],
        simd_width=entry["simd_width"],
        max_threads_per_block=entry["max_threads_per_block"],
        max_threads_per_cu=entry["max_threads_per_cu"],
        max_block_dims=tuple(entry["max_block_dims"]),
        max_grid_dims=tuple(entry["max_grid_dims"]),
        shared_mem_per_block=entry["shared_mem_per_block"],
        shared_mem_per_block_optin=entry["shared_mem_per_block_optin"],
        shared_mem_per_cu=entry["shared_mem_per_cu"],
        registers_per_block=entry["regs_per_block"],
        registers_per_cu=entry["regs_per_cu"],
        l2_bytes=entry["l2_bytes"],
        memory_total=entry["memory_bytes"],
        memory_bandwidth_gbps=entry["memory_bandwidth_gbps"],
        peak_fp16_tflops=entry["peak_fp16_tensor_tflops"],
        dtypes=frozenset(dtypes),
        features=frozenset(features | {"async_alloc", "managed_memory"}),
        allocation_granularity=entry["allocation_granularity"],
    )
