"""One CUDA device: capabilities, streams, events, allocator and launcher (CuPy underneath)."""

from __future__ import annotations

import threading
from typing import Any

from hal_cuda._capabilities import ATTRIBUTE_NAMES, capabilities_from_properties

from hal_core import AllocationPolicy, DeviceCapabilities, DeviceHandle

from . import _env
from ._cupy import cupy
from ._launcher import CupyLauncher
from ._memory import CupyAllocator
from ._stream import CudaEvent, CudaStream

__all__ = ["CudaDevice", "query_capabilities"]


def query_capabilities(index: int) -> DeviceCapabilities:
    """Capabilities of device ``index`` read through CuPy (creates the device's context)."""
    cp = cupy()
    runtime = cp.cuda.runtime
    props = runtime.getDeviceProperties(index)
    attributes = {}
    for name in ATTRIBUTE_NAMES:
        code = getattr(runtime, f"cudaDevAttr{name}", None)
        if code is None:
            continue
        try:
            attributes[name] = int(runtime.deviceGetAttribute(code, index))
        except runtime.CUDARuntimeError:  # attribute unknown to this driver
            continue
    with cp.cuda.Device(index):
        free, _total = runtime.memGetInfo()
    return capabilities_from_properties(props, attributes, memory_free=free)


class CudaDevice(DeviceHandle):
    """A visible GPU. Cheap to make; the context, pools and compiled kernels come on first use."""

    def __init__(self, index: int, *, policy: AllocationPolicy | str | None = None) -> None:
        self._index = index
        self._policy = AllocationPolicy(policy or _env.allocator_policy())
        self._caps: DeviceCapabilities | None = None
        self._allocator: CupyAllocator | None = None
        self._launcher: CupyLauncher | None = None
        self._default_stream: CudaStream | None = None
        self._lock = threading.Lock()

    @property
    def index(self) -> int:
        return self._index

    @property
    def capabilities(self) -> DeviceCapabilities:
        """Read once; ``memory_free`` is as of that first read (see :meth:`refresh_capabilities`)."""
        if self._caps is None:
            self._caps = query_capabilities(self._index)
        return self._caps

    def refresh_capabilities(self) -> DeviceCapabilities:
        """Read the capabilities again (``memory_free`` now)."""
        self._caps = query_capabilities(self._index)
        return self._caps

    @property
    def default_stream(self) -> CudaStream:
        if self._default_stream is None:
            self._default_stream = CudaStream(self._index, cupy().cuda.Stream.null)
        return self._default_stream

    def current_stream(self) -> CudaStream:
        """CuPy's current stream of this device (where ops enqueue)."""
        cp = cupy()
        with cp.cuda.Device(self._index):
            return CudaStream(self._index, cp.cuda.get_current_stream())

    def create_stream(self) -> CudaStream:
        cp = cupy()
        with cp.cuda.Device(self._index):
            return CudaStream(self._index, cp.cuda.Stream(non_blocking=True))

    def wrap_stream(self, obj: Any) -> CudaStream:
        """A hal stream over a foreign stream (anything exposing ``__cuda_stream__``); not owned."""
        return CudaStream.wrap(obj, self._index)

    def create_event(self, *, timing: bool = True) -> CudaEvent:
        return CudaEvent(self._index, timing=timing)

    def synchronize(self) -> None:
        cupy().cuda.Device(self._index).synchronize()

    @property
    def allocator(self) -> CupyAllocator:
        with self._lock:
            if self._allocator is None:
                caps = self.capabilities
                self._allocator = CupyAllocator(
                    self._index, self._policy, name=f"cuda:{self._index} ({caps.name})",
                    async_supported=caps.has("async_alloc"), managed_supported=caps.has("managed_memory"))
            return self._allocator

    @property
    def launcher(self) -> CupyLauncher:
        with self._lock:
            if self._launcher is None:
                self._launcher = CupyLauncher(self._index, lambda: self.capabilities)
            return self._launcher
