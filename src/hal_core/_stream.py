"""Streams and events: ordered work queues and the markers that sync them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["Event", "Stream"]


class Event(ABC):
    """A marker recorded on a stream; completes when the work before it has."""

    @abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Capture the current end of ``stream`` (the device's default stream if None)."""
        raise NotImplementedError("The 'record' method must be implemented.")

    @abstractmethod
    def query(self) -> bool:
        """True when the recorded work has completed; never blocks."""
        raise NotImplementedError("The 'query' method must be implemented.")

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the recorded work has completed."""
        raise NotImplementedError("The 'synchronize' method must be implemented.")

    @abstractmethod
    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and ``end``; both must have completed."""
        raise NotImplementedError("The 'elapsed_ms' method must be implemented.")


class Stream(ABC):
    """An ordered queue of work on one device.

    Work on one stream runs in order; across streams, order only through
    :meth:`wait_event`. A stream may be used as a context manager that
    makes it current; device backends (CUDA) enqueue ops on the current
    stream, while host backends may run ops eagerly on the calling thread,
    so synchronize a stream before an op reads what a launch on it wrote.
    """

    @abstractmethod
    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at the current end of this stream."""
        raise NotImplementedError("The 'record_event' method must be implemented.")

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; does not block the host."""
        raise NotImplementedError("The 'wait_event' method must be implemented.")

    @abstractmethod
    def query(self) -> bool:
        """True when all work queued so far has completed; never blocks."""
        raise NotImplementedError("The 'query' method must be implemented.")

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work queued so far has completed."""
        raise NotImplementedError("The 'synchronize' method must be implemented.")

    @property
    def native(self) -> Any:
        """The vendor object underneath (e.g. a ``cupy.cuda.Stream``), or None."""
        return None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
