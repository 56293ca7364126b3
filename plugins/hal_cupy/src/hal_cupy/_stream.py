"""Streams and events over ``cupy.cuda.Stream`` / ``cupy.cuda.Event``.

Foreign streams (torch, CUDA Python, anything exposing ``__cuda_stream__``)
are wrapped without taking ownership: see :func:`native_stream`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from hal_core import Event, Stream

from ._cupy import cupy
from ._index_errors import raise_recorded

__all__ = ["CupyEvent", "CupyStream", "native_stream", "stream_handle"]


def stream_handle(obj: Any) -> int:
    """The ``cudaStream_t`` of an object exposing ``__cuda_stream__`` (method or attribute).

    The protocol answers ``(version, handle)``; a bare int is accepted too.
    """
    proto = getattr(obj, "__cuda_stream__", None)
    if proto is None:
        raise TypeError(f"{type(obj).__name__} does not expose __cuda_stream__")
    value = proto() if callable(proto) else proto
    if isinstance(value, tuple):
        if len(value) != 2:
            raise TypeError(f"__cuda_stream__ returned {value!r}; expected (version, handle)")
        value = value[1]
    return int(value)


class _Protocol:
    """A stream producer seen through ``__cuda_stream__`` as the method CuPy's ``Stream.from_external`` calls.

    ``stream_handle`` reads the handle (method, attribute or bare int); the
    producer is kept, so the CuPy stream holds it alive.
    """

    __slots__ = ("handle", "producer")

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.handle = stream_handle(producer)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def native_stream(stream: Any, device_index: int) -> Any:
    """A ``cupy.cuda.Stream`` for ``stream``: a hal Stream, a CuPy stream, a foreign stream, or None (current)."""
    cp = cupy()
    if stream is None:
        with cp.cuda.Device(device_index):
            return cp.cuda.get_current_stream()
    if isinstance(stream, Stream):
        native = stream.native
        if native is None:
            raise TypeError(f"stream {stream!r} has no CUDA stream underneath")
        return native
    base = getattr(cp.cuda.stream, "_BaseStream", cp.cuda.Stream)  # Stream and ExternalStream
    if isinstance(stream, base):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        from_external = getattr(cp.cuda.Stream, "from_external", None)
        if from_external is None:  # CuPy 13
            return cp.cuda.ExternalStream(stream_handle(stream), device_index)
        # CuPy >= 14 records the current device as the stream's, and calls __cuda_stream__()
        with cp.cuda.Device(device_index):
            return from_external(_Protocol(stream))
    raise TypeError(f"expected a hal Stream, a cupy.cuda.Stream or an object with __cuda_stream__, "
                    f"got {type(stream).__name__}")


class CupyEvent(Event):
    """A ``cupy.cuda.Event`` on one device."""

    def __init__(self, device_index: int, *, timing: bool = True, native: Any = None) -> None:
        cp = cupy()
        self._device_index = device_index
        if native is None:
            with cp.cuda.Device(device_index):
                native = cp.cuda.Event(disable_timing=not timing)
        self._native = native

    @property
    def native(self) -> Any:
        return self._native

    def record(self, stream: Stream | Any = None) -> None:
        with cupy().cuda.Device(self._device_index):
            self._native.record(native_stream(stream, self._device_index))

    def query(self) -> bool:
        return bool(self._native.done)

    def synchronize(self) -> None:
        """Wait for the recorded work, then raise the index errors its kernels recorded (:mod:`._index_errors`)."""
        self._native.synchronize()
        raise_recorded(self._device_index)

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, CupyEvent):
            raise TypeError(f"elapsed_ms needs another CupyEvent, got {type(end).__name__}")
        return float(cupy().cuda.get_elapsed_time(self._native, end._native))


class CupyStream(Stream):
    """A CuPy stream (owned, or a foreign one wrapped) on one device.

    As a context manager it makes its device and itself current, so ops run
    inside enqueue on it.
    """

    def __init__(self, device_index: int, native: Any) -> None:
        self._device_index = device_index
        self._native = native
        self._contexts: list[ExitStack] = []

    @classmethod
    def wrap(cls, obj: Any, device_index: int) -> CupyStream:
        """Wrap a CuPy stream or any object exposing ``__cuda_stream__`` (not owned)."""
        return cls(device_index, native_stream(obj, device_index))

    @property
    def native(self) -> Any:
        return self._native

    @property
    def ptr(self) -> int:
        return int(self._native.ptr)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else CupyEvent(self._device_index)
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CupyEvent):
            raise TypeError(f"wait_event needs a CupyEvent, got {type(event).__name__}")
        with cupy().cuda.Device(self._device_index):
            self._native.wait_event(event.native)

    def query(self) -> bool:
        return bool(self._native.done)

    def synchronize(self) -> None:
        """Wait for the queued work, then raise the index errors its kernels recorded (:mod:`._index_errors`)."""
        self._native.synchronize()
        raise_recorded(self._device_index)

    def __enter__(self) -> CupyStream:
        stack = ExitStack()
        stack.enter_context(cupy().cuda.Device(self._device_index))
        stack.enter_context(self._native)
        self._contexts.append(stack)
        return self

    def __exit__(self, *exc: object) -> None:
        self._contexts.pop().close()

    def __repr__(self) -> str:
        return f"<CupyStream device={self._device_index} ptr={self.ptr:#x}>"
