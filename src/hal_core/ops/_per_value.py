"""What was found once about a value that cannot be hashed (a frozen ``ExpertWeights``), kept while it lives."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerValue"]

T = TypeVar("T")


class PerValue(Generic[T]):
    """``value -> found`` by identity, held weakly: an entry goes when its value is freed, so a new value at the
    same address is never taken for it. For values with ``__hash__ = None`` (arrays inside, compared by value),
    which ``weakref.WeakKeyDictionary`` cannot key."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[weakref.ref[Any], T]] = {}

    def get(self, value: Any, find: Callable[[Any], T]) -> T:
        """What ``find(value)`` returned the first time for this very ``value`` (found now on a first call)."""
        key = id(value)
        entry = self._found.get(key)
        if entry is not None and entry[0]() is value:
            return entry[1]
        found = find(value)
        self._found[key] = (weakref.ref(value, lambda _: self._found.pop(key, None)), found)
        return found
