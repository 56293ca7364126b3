"""The vendor interface: what a GPU vendor plugin supplies to the shared CuPy layer.

Everything else (devices, streams, events, allocators, the launcher, the op
implementations, the kernel sources and their specialisation rules) is
shared and asks capability questions, never a vendor's name. A vendor
plugin implements :class:`GpuPlatform` once, as a stateless object, and
declares a backend class that names it (see :class:`hal_cupy.CupyBackend`).

What differs per vendor, and therefore lives here:

- the driver probe (``availability``), cheap and side-effect free: no CuPy
  import before the driver has answered;
- capabilities from the device properties CuPy reports (CUDA's ``sm_XY``
  and warp 32, HIP's ``gcnArchName`` and wavefront 64, shared memory vs LDS);
- the compiler options (NVRTC or HIPRTC behind ``cupy.RawModule``);
- the kernel prelude (the vendor's spelling of shuffles, barriers,
  conversions, dot products and atomics);
- the DLPack device type codes of the platform's arrays.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from hal_core import Availability

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["DLPACK_CPU", "GpuPlatform"]

#: DLPack's ``kDLCPU`` (host memory; never a GPU platform's own).
DLPACK_CPU = 1


class GpuPlatform(ABC):
    """One GPU vendor under CuPy (stateless; one instance per vendor plugin)."""

    #: Backend name (``HAL_<NAME>_*`` environment variables and op implementation names derive from it).
    name: ClassVar[str]
    #: DLPack device type codes of the memory this platform's arrays live in.
    dlpack_device_types: ClassVar[frozenset[int]]
    #: ``deviceGetAttribute`` names (without the runtime's prefix) read besides the device properties.
    attribute_names: ClassVar[tuple[str, ...]] = ()
    #: The prefix CuPy's runtime module gives those attribute constants.
    attribute_prefix: ClassVar[str] = "cudaDevAttr"

    @abstractmethod
    def availability(self) -> Availability:
        """Whether the platform is usable here, with a specific reason and remedy when not.

        Must import no CuPy before the vendor's driver reports a device, and
        create no device context.
        """
        raise NotImplementedError("GpuPlatform.availability must be implemented by the vendor plugin")

    @abstractmethod
    def capabilities(self, props: Mapping[str, Any], attributes: Mapping[str, Any], *,
                     memory_free: int | None = None) -> DeviceCapabilities:
        """The capabilities of one device from ``getDeviceProperties`` and the :attr:`attribute_names` values.

        A pure function of its arguments (tests feed it saved profiles).
        """
        raise NotImplementedError("GpuPlatform.capabilities must be implemented by the vendor plugin")

    @abstractmethod
    def prelude(self) -> str:
        """The text of the vendor prelude prepended to every kernel source (defines ``HAL_PRELUDE``)."""
        raise NotImplementedError("GpuPlatform.prelude must be implemented by the vendor plugin")

    @abstractmethod
    def compile_options(self, *, fmad: bool) -> tuple[str, ...]:
        """Options for ``cupy.RawModule`` besides the kernel's own ``-D`` defines.

        ``fmad=False`` asks for no contraction of multiply and add (bit-reproducible results).
        """
        raise NotImplementedError("GpuPlatform.compile_options must be implemented by the vendor plugin")

    def static_shared_limit(self, capabilities: DeviceCapabilities) -> int:
        """Shared memory per block usable without opting in; more needs ``max_dynamic_shared_size_bytes``."""
        return capabilities.shared_mem_per_block

    def warp_mma_level(self, capabilities: DeviceCapabilities) -> int:
        """The warp matrix instructions the prelude provides on that device (``HAL_MMA_SYNC``); 0: none.

        ``hal_mma.cuh`` (``mma.sync``, ``ldmatrix``, ``cp.async``) is written for the level these instructions
        are specified at, numbered like compute capabilities (major * 10 + minor). A specialisation whose
        ``min_sm`` exceeds the level (the tensor-core kernels) is neither selected nor built for that device.
        """
        return 0

    def pip_install(self) -> str:
        """The command that installs this platform's CuPy (for messages)."""
        return "pip install cupy"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
