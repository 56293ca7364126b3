"""The CUDA platform: what hal-cuda supplies to the shared CuPy layer (see :class:`hal_cupy.GpuPlatform`)."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar

from hal_cupy import GpuPlatform

from hal_core import Availability

from ._capabilities import ATTRIBUTE_NAMES, capabilities_from_properties
from ._probe import PIP_INSTALL, probe

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["CUDA", "CudaPlatform"]

#: Static shared memory a block may use without opting in (CUDA's fixed 48 KiB).
STATIC_SHARED_LIMIT = 48 * 1024


class CudaPlatform(GpuPlatform):
    """NVIDIA GPUs: the driver probed with ctypes, ``cudaDeviceProp`` capabilities, NVRTC options."""

    name: ClassVar[str] = "cuda"
    #: kDLCUDA, kDLCUDAHost, kDLCUDAManaged.
    dlpack_device_types: ClassVar[frozenset[int]] = frozenset({2, 3, 13})
    attribute_names: ClassVar[tuple[str, ...]] = ATTRIBUTE_NAMES

    def availability(self) -> Availability:
        result = probe()
        return Availability(result.ok, result.reason, result.remedy)

    def capabilities(self, props: Mapping[str, Any], attributes: Mapping[str, Any], *,
                     memory_free: int | None = None) -> DeviceCapabilities:
        return capabilities_from_properties(props, attributes, memory_free=memory_free)

    def prelude(self) -> str:
        return resources.files("hal_cuda.kernels").joinpath("prelude_cuda.cuh").read_text()

    def compile_options(self, *, fmad: bool) -> tuple[str, ...]:
        """NVRTC options: ``-fmad=false`` when contraction is off (CuPy adds ``-arch`` and ``-std`` itself)."""
        return () if fmad else ("-fmad=false",)

    def static_shared_limit(self, capabilities: DeviceCapabilities) -> int:
        """48 KiB: beyond it a kernel opts in with ``cudaFuncAttributeMaxDynamicSharedMemorySize``."""
        return STATIC_SHARED_LIMIT

    def warp_mma_level(self, capabilities: DeviceCapabilities) -> int:
        """The compute capability of ``sm_XY`` (``sm_90a`` -> 90): PTX ``mma.sync`` is available at every level."""
        arch = capabilities.arch
        digits = arch.removeprefix("sm_").rstrip("af")
        return int(digits) if arch.startswith("sm_") and digits.isdigit() else 0

    def pip_install(self) -> str:
        return PIP_INSTALL


#: The one instance.
CUDA = CudaPlatform()
