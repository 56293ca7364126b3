"""The ROCm platform: what hal-rocm supplies to the shared CuPy layer (see :class:`hal_cupy.GpuPlatform`)."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar

from hal_cupy import GpuPlatform

from hal_core import Availability

from ._capabilities import capabilities_from_properties
from ._probe import PIP_INSTALL, probe

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["COMPILE_OPTIONS", "ROCM", "RocmPlatform"]

#: HIPRTC options of every kernel. ``-munsafe-fp-atomics`` keeps float ``atomicAdd`` a hardware atomic
#: (``global_atomic_add_f32``) on CDNA2 instead of a compare-and-swap loop; the split-K GEMM accumulates into a
#: workspace in ordinary device memory, where the hardware atomic is exact (it only skips fine-grained host memory).
COMPILE_OPTIONS = ("-munsafe-fp-atomics",)


class RocmPlatform(GpuPlatform):
    """AMD GPUs: the HIP runtime probed with ctypes, ``hipDeviceProp_t`` capabilities, HIPRTC options."""

    name: ClassVar[str] = "rocm"
    #: kDLROCM, kDLROCMHost.
    dlpack_device_types: ClassVar[frozenset[int]] = frozenset({10, 11})
    attribute_names: ClassVar[tuple[str, ...]] = ()

    def availability(self) -> Availability:
        result = probe()
        return Availability(result.ok, result.reason, result.remedy)

    def capabilities(self, props: Mapping[str, Any], attributes: Mapping[str, Any], *,
                     memory_free: int | None = None) -> DeviceCapabilities:
        return capabilities_from_properties(props, attributes, memory_free=memory_free)

    def prelude(self) -> str:
        return resources.files("hal_rocm.kernels").joinpath("prelude_hip.cuh").read_text()

    def compile_options(self, *, fmad: bool) -> tuple[str, ...]:
        """HIPRTC options: hardware float atomics; ``-ffp-contract=off`` when contraction is off."""
        return (*COMPILE_OPTIONS, *(() if fmad else ("-ffp-contract=off",)))

    def pip_install(self) -> str:
        return PIP_INSTALL


#: The one instance.
ROCM = RocmPlatform()
