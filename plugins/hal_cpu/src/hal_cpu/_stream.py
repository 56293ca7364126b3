"""Host streams and events.

Each stream owns one worker thread (started on first use) that runs the
work submitted to it in order: kernel launches, event markers and waits.
Submitting never blocks the host, so :meth:`CpuStream.query` and
:meth:`CpuEvent.query` really report progress, and an event's time stamp
(``time.perf_counter_ns``) is taken when the worker reaches it, after all
work submitted before it has completed.

An exception raised by submitted work is kept and re-raised by the next
:meth:`CpuStream.synchronize` (like a sticky CUDA error); later work on the
stream still runs.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Protocol

from hal_core import Event, Stream

__all__ = ["CpuEvent", "CpuStream", "StreamOwner"]


class StreamOwner(Protocol):
    """What a stream needs of its device (``CpuDevice``): the per-thread stack of current streams.

    A protocol, so that this module does not import the device module that imports it.
    """

    def current_stream(self) -> Stream: ...

    def _push_stream(self, stream: CpuStream) -> None: ...

    def _pop_stream(self, stream: CpuStream) -> None: ...


class _WorkQueue:
    """The state a stream shares with its worker thread (the thread holds no stream reference).

    A stream that is dropped is collected; its finalizer closes the queue,
    and the worker runs what is left, then exits.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: deque[Callable[[], object]] = deque()
        self.pending = 0  # queued plus running
        self.error: BaseException | None = None
        self.closed = False
        self.thread: threading.Thread | None = None

    def submit(self, work: Callable[[], object]) -> None:
        with self.cond:
            if self.closed:
                raise RuntimeError("the stream was closed; create a new one")
            self.items.append(work)
            self.pending += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="hal-cpu-stream", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.items and not self.closed:
                    self.cond.wait()
                if not self.items:
                    return
                work = self.items.popleft()
            try:
                work()
            except BaseException as exc:
                with self.cond:
                    if self.error is None:
                        self.error = exc
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

    def synchronize(self) -> None:
        """Wait until everything submitted so far has run; re-raise (once) the first error it raised."""
        with self.cond:
            while self.pending:
                self.cond.wait()
            error, self.error = self.error, None
        if error is not None:
            raise error

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class CpuStream(Stream):
    """An ordered queue of host work run by its own worker thread."""

    def __init__(self, device: StreamOwner) -> None:
        self._device = device
        self._work = _WorkQueue()
        weakref.finalize(self, self._work.close)

    @property
    def device(self) -> StreamOwner:
        return self._device

    def submit(self, work: Callable[[], object]) -> None:
        """Queue ``work`` (a no-argument callable) after everything already on this stream."""
        self._work.submit(work)

    def record_event(self, event: Event | None = None) -> CpuEvent:
        if event is None:
            event = CpuEvent(self._device)
        if not isinstance(event, CpuEvent):
            raise TypeError(f"expected a CpuEvent, got {type(event).__name__}")
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CpuEvent):
            raise TypeError(f"expected a CpuEvent, got {type(event).__name__}")
        done = event._current  # the record as of now; a later re-record does not matter
        self.submit(done.wait)

    def query(self) -> bool:
        with self._work.cond:
            return self._work.pending == 0

    def synchronize(self) -> None:
        self._work.synchronize()

    def close(self) -> None:
        """Let the worker thread finish queued work and exit; the stream accepts no more work."""
        self._work.close()

    def __enter__(self) -> CpuStream:
        self._device._push_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._device._pop_stream(self)

    def __repr__(self) -> str:
        return f"<CpuStream at {id(self):#x}>"


class CpuEvent(Event):
    """A marker on a :class:`CpuStream`; an event never recorded counts as complete."""

    def __init__(self, device: StreamOwner | None = None, *, timing: bool = True) -> None:
        self._device = device
        self._timing = timing
        self._lock = threading.Lock()
        self._current = threading.Event()
        self._current.set()
        self._time_ns: int | None = None
        self._recorded = False

    @property
    def timing(self) -> bool:
        return self._timing

    def record(self, stream: Stream | None = None) -> None:
        if stream is None:
            if self._device is None:
                raise ValueError("this event has no device; pass the stream to record on")
            stream = self._device.current_stream()
        if not isinstance(stream, CpuStream):
            raise TypeError(f"expected a CpuStream, got {type(stream).__name__}")
        done = threading.Event()
        with self._lock:
            self._current, self._time_ns, self._recorded = done, None, True

        def mark() -> None:
            stamp = time.perf_counter_ns()
            with self._lock:
                if self._current is done:
                    self._time_ns = stamp
            done.set()

        stream.submit(mark)

    def query(self) -> bool:
        return self._current.is_set()

    def synchronize(self) -> None:
        self._current.wait()

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, CpuEvent):
            raise TypeError(f"expected a CpuEvent, got {type(end).__name__}")
        if not (self._timing and end._timing):
            raise ValueError("elapsed_ms needs both events created with timing=True")
        start_ns, end_ns = self._stamp("start"), end._stamp("end")
        return (end_ns - start_ns) / 1e6

    def _stamp(self, which: str) -> int:
        with self._lock:
            recorded, stamp = self._recorded, self._time_ns
        if not recorded:
            raise RuntimeError(f"the {which} event was never recorded; call record(stream) first")
        if stamp is None:
            raise RuntimeError(f"the {which} event has not completed yet; synchronize it first")
        return stamp
