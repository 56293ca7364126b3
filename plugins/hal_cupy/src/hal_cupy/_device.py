"""One GPU: capabilities, streams, events, allocator and launcher (CuPy underneath, any platform)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from hal_core import AllocationPolicy, DeviceHandle

from . import _env
from ._cupy import cupy
from ._index_errors import raise_recorded
from ._launcher import CupyLauncher
from ._memory import CupyAllocator
from ._platform import GpuPlatform
from ._stream import CupyEvent, CupyStream

if TYPE_CHECKING:
    from hal_core import DeviceCapabilities

__all__ = ["CupyDevice", "query_capabilities"]


def query_capabilities(index: int, platform: GpuPlatform) -> DeviceCapabilities:
    """Capabilities of device ``index`` read through CuPy (creates the device's context)."""
    cp = cupy()
    runtime = cp.cuda.runtime
    props = runtime.getDeviceProperties(index)
    attributes = {}
    for name in platform.attribute_names:
        code = getattr(runtime, f"{platform.attribute_prefix}{name}", None)
        if code is None:
            continue
        try:
            attributes[name] = int(runtime.deviceGetAttribute(code, index))
        except runtime.CUDARuntimeError:  # attribute unknown to this driver
            continue
    with cp.cuda.Device(index):
        free, _total = runtime.memGetInfo()
    return platform.capabilities(props, attributes, memory_free=free)


class CupyDevice(DeviceHandle):
    """A visible GPU of ``platform``. Cheap to make; the context, pools and compiled kernels come on first use."""

    def __init__(self, index: int, platform: GpuPlatform, *, policy: AllocationPolicy | str | None = None) -> None:
        self._index = index
        self._platform = platform
        self._policy = AllocationPolicy(policy or _env.allocator_policy(platform.name))
        self._caps: DeviceCapabilities | None = None
        self._allocator: CupyAllocator | None = None
        self._launcher: CupyLauncher | None = None
        self._default_stream: CupyStream | None = None
        self._lock = threading.Lock()

    @property
    def index(self) -> int:
        return self._index

    @property
    def platform(self) -> GpuPlatform:
        return self._platform

    @property
    def capabilities(self) -> DeviceCapabilities:
        """Read once; ``memory_free`` is as of that first read (see :meth:`refresh_capabilities`)."""
        if self._caps is None:
            self._caps = query_capabilities(self._index, self._platform)
        return self._caps

    def refresh_capabilities(self) -> DeviceCapabilities:
        """Read the capabilities again (``memory_free`` now)."""
        self._caps = query_capabilities(self._index, self._platform)
        return self._caps

    @property
    def default_stream(self) -> CupyStream:
        if self._default_stream is None:
            self._default_stream = CupyStream(self._index, cupy().cuda.Stream.null)
        return self._default_stream

    def current_stream(self) -> CupyStream:
        """CuPy's current stream of this device (where ops enqueue)."""
        cp = cupy()
        with cp.cuda.Device(self._index):
            return CupyStream(self._index, cp.cuda.get_current_stream())

    def create_stream(self) -> CupyStream:
        cp = cupy()
        with cp.cuda.Device(self._index):
            return CupyStream(self._index, cp.cuda.Stream(non_blocking=True))

    def wrap_stream(self, obj: Any) -> CupyStream:
        """A hal stream over a foreign stream (anything exposing ``__cuda_stream__``); not owned."""
        return CupyStream.wrap(obj, self._index)

    def create_event(self, *, timing: bool = True) -> CupyEvent:
        return CupyEvent(self._index, timing=timing)

    def synchronize(self) -> None:
        """Wait for all the device's work, then raise the index errors its kernels recorded (:mod:`._index_errors`)."""
        cupy().cuda.Device(self._index).synchronize()
        raise_recorded(self._index)

    @property
    def allocator(self) -> CupyAllocator:
        with self._lock:
            if self._allocator is None:
                caps = self.capabilities
                self._allocator = CupyAllocator(
                    self._index, self._policy, name=f"{self._platform.name}:{self._index} ({caps.name})",
                    async_supported=caps.has("async_alloc"), managed_supported=caps.has("managed_memory"))
            return self._allocator

    @property
    def launcher(self) -> CupyLauncher:
        with self._lock:
            if self._launcher is None:
                self._launcher = CupyLauncher(self._index, lambda: self.capabilities, platform=self._platform)
            return self._launcher
