"""What a call path builds once per value and call signature, kept with the value while it lives.

The values are frozen weights (a :class:`~hal_core.quant.QuantizedWeight`, an
:class:`~hal_core.quant.ExpertWeights`): they compare by value and cannot be hashed, so they are found by
identity, and held weakly, so what is kept for them goes with them (a new value at a freed one's address never
finds it). Each value keeps at most ``limit`` signatures, the oldest dropped first.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

__all__ = ["KeptPerValue"]

T = TypeVar("T")


class KeptPerValue(Generic[T]):
    """``(value, signature) -> thing``, by the value's identity, held weakly, at most ``limit`` signatures a value."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: id(value) -> (a weak reference to it, {signature: thing} oldest first); the reference is checked on
        #: every look-up and its callback drops the entry when the value is freed.
        self.entries: dict[int, tuple[weakref.ref[Any], dict[tuple[Any, ...], T]]] = {}
        #: Reentrant: a value's callback may run in a thread that holds it, when the cyclic garbage collector
        #: frees some value during an allocation inside :meth:`get`.
        self.lock = threading.RLock()

    def get(self, value: Any, signature: tuple[Any, ...], build: Callable[[], T],
            keep: Callable[[T], bool] = lambda _: True) -> T:
        """The thing kept for ``value`` and ``signature``, else ``build()``, kept when ``keep`` says so."""
        key = id(value)
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is value:
            found = entry[1].get(signature)
            if found is not None:
                return found
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and entry[0]() is value and signature in entry[1]:
                return entry[1][signature]  # built by another thread meanwhile
            thing = build()
            if not keep(thing):
                return thing
            entry = self.entries.get(key)
            if entry is None or entry[0]() is not value:
                entry = self.entries[key] = (weakref.ref(value, partial(self._forget, key)), {})
            per_value = entry[1]
            while len(per_value) >= self.limit:
                del per_value[next(iter(per_value))]
            per_value[signature] = thing
            return thing

    def found(self, value: Any) -> list[T]:
        """What is kept for ``value`` now, oldest first."""
        entry = self.entries.get(id(value))
        return list(entry[1].values()) if entry is not None and entry[0]() is value else []

    def count(self) -> int:
        """How many things are kept now, over every value alive."""
        return sum(len(things) for ref, things in list(self.entries.values()) if ref() is not None)

    def _forget(self, key: int, _ref: object = None) -> None:
        """Drop the entry of a freed value (a live value that took its id since keeps its own)."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and entry[0]() is None:
                del self.entries[key]
