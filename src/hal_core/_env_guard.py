"""Plugin code may not change hal's settings: its ``HAL_*`` writes to ``os.environ`` are undone and reported.

The ``HAL_*`` switches (``HAL_CHECK_INDICES``, ``HAL_STRICT``, ...) are the
user's. While hal runs a plugin's code (its import and hooks at discovery,
its ``availability()`` probe, the binding of its backend), :func:`watch`
records every write to a ``HAL_*`` variable of ``os.environ`` made on that
thread, with the value the variable had before; when the code returns, each
variable it changed is put back, and the caller refuses the plugin with
:func:`describe`'s reason.

Writes are told apart by thread rather than by comparing snapshots taken
before and after: the probes of several plugins run at once in their own
threads, and the user's code may set variables meanwhile, so a snapshot
comparison would blame a plugin for another's change and undo the user's
own. While any watch is open, ``os.environ`` is an instance of a subclass
of its class that notes writes (``update``, ``setdefault``, ``pop`` and
``del`` all go through it); the class is put back when the last watch
closes. What this cannot see: writes from threads the plugin code starts,
and ``os.putenv``, which hal never reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["PREFIX", "EnvChange", "describe", "watch"]

#: The variables plugin code may not change.
PREFIX = "HAL_"

_Environ = os._Environ  # the class of os.environ


@dataclass(frozen=True)
class EnvChange:
    """One ``HAL_*`` variable plugin code changed: its value before and after (None: unset)."""

    name: str
    before: str | None
    after: str | None

    def __str__(self) -> str:
        def shown(value: str | None) -> str:
            return "unset" if value is None else repr(value)

        return f"{self.name} from {shown(self.before)} to {shown(self.after)}"


def describe(changes: Iterable[EnvChange], where: str) -> str:
    """The reason a plugin is refused for ``changes`` made while hal ran ``where`` (e.g. "its availability()")."""
    listing = " and ".join(str(change) for change in changes)
    return (f"{where} changed {listing}; hal put the user's value back and refuses the plugin: plugins may not "
            f"change HAL_* variables (fix the plugin, or disable it with HAL_DISABLE_PLUGINS)")


class _Thread(threading.local):
    def __init__(self) -> None:
        #: One dict per open watch of this thread, innermost last: variable -> value before its first write.
        self.stack: list[dict[str, str | None]] = []


_thread = _Thread()
_lock = threading.Lock()
_open_watches = 0


def _note(environ: _Environ[str], key: object) -> None:
    stack = _thread.stack
    if stack and isinstance(key, str) and key.startswith(PREFIX) and key not in stack[-1]:
        stack[-1][key] = environ.get(key)


class _Recording(_Environ):
    """``os.environ``'s class while a watch is open: it notes the ``HAL_*`` writes of watched threads."""

    def __setitem__(self, key: str, value: str) -> None:
        _note(self, key)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        _note(self, key)
        super().__delitem__(key)


def _open() -> None:
    global _open_watches
    with _lock:
        if _open_watches == 0 and type(os.environ) is _Environ:
            os.environ.__class__ = _Recording
        _open_watches += 1


def _close() -> None:
    global _open_watches
    with _lock:
        _open_watches -= 1
        if _open_watches == 0 and type(os.environ) is _Recording:
            os.environ.__class__ = _Environ  # type: ignore[assignment]  # back to its own class


def _put_back(written: dict[str, str | None]) -> list[EnvChange]:
    """Restore each written variable that differs from its value before; return those changes."""
    changes = []
    environ = os.environ
    for name, before in written.items():
        after = environ.get(name)
        if after == before:
            continue
        changes.append(EnvChange(name, before, after))
        if not isinstance(environ, _Environ):  # pragma: no cover - os.environ replaced by someone
            continue
        if before is None:  # the base class's methods: putting back is no write of the code watched
            _Environ.__delitem__(environ, name)
        else:
            _Environ.__setitem__(environ, name, before)
    return changes


@contextmanager
def watch() -> Iterator[list[EnvChange]]:
    """Run plugin code in the block; on exit the list holds the ``HAL_*`` changes it made, already undone.

    Watches nest: a write counts for the innermost watch of its thread.
    """
    changes: list[EnvChange] = []
    written: dict[str, str | None] = {}
    _thread.stack.append(written)
    _open()
    try:
        yield changes
    finally:
        _thread.stack.pop()
        _close()
        changes.extend(_put_back(written))
