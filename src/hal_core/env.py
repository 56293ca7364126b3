"""Reading ``HAL_*`` environment variables: the one parser hal-core and every plugin use.

Each function reads its variable when called (so a change between calls is
seen) and raises :class:`~hal_core.EnvironmentVariableError` naming the
variable, its value and what it accepts when the value is not one of them:
a misspelt switch is an error at its first use, never silently read as on or
off. Surrounding whitespace is ignored; an unset or empty variable means the
documented default.

Booleans follow one rule: a variable names the behaviour it switches
(``HAL_STRICT``, ``HAL_CHECK_INDICES``, ``HAL_CUDA_FMAD``); one of
:data:`ON_SPELLINGS` turns it on, one of :data:`OFF_SPELLINGS` turns it off
(any case), whatever its default is. See docs/environment.md.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from typing import Any

from ._errors import EnvironmentVariableError

__all__ = [
    "NAME_CHARACTERS",
    "OFF_SPELLINGS",
    "ON_SPELLINGS",
    "EnvironmentVariableError",
    "choice",
    "flag",
    "integer",
    "name_list",
    "number",
    "text",
]

#: Values (any case) that turn a boolean variable on.
ON_SPELLINGS = ("1", "true", "yes", "on")
#: Values (any case) that turn a boolean variable off.
OFF_SPELLINGS = ("0", "false", "no", "off")


#: CPython's ``os.environ`` keeps the process environment in an encoded dict that every write through it
#: updates: reading that dict costs a look-up, where ``os.environ.get`` of an unset name raises and catches a
#: KeyError in Python (hal reads a few switches on every op call). Used only while ``os.environ`` is still
#: this object; anything else (another mapping put in its place) is read through ``os.environ.get``.
_ENVIRON: Any = os.environ
_ENCODED: dict[Any, Any] | None = getattr(_ENVIRON, "_data", None)
_KEYS: dict[str, Any] = {}


def _raw(name: str) -> str | None:
    """The value of ``name`` in ``os.environ`` as it is now (None when unset)."""
    environ = os.environ
    if environ is not _ENVIRON or _ENCODED is None:
        return environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENVIRON.encodekey(name)
    found = _ENCODED.get(key)
    return None if found is None else str(_ENVIRON.decodevalue(found))


def text(name: str) -> str | None:
    """The stripped value of ``name``, or None when it is unset or empty."""
    value = _raw(name)
    if value is None:
        return None
    return value.strip() or None


def flag(name: str, default: bool) -> bool:
    """A boolean variable: on for :data:`ON_SPELLINGS`, off for :data:`OFF_SPELLINGS`, else ``default`` if unset."""
    value = text(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ON_SPELLINGS:
        return True
    if lowered in OFF_SPELLINGS:
        return False
    raise EnvironmentVariableError(
        name, value, f"{', '.join(ON_SPELLINGS)} (on) or {', '.join(OFF_SPELLINGS)} (off), in any case"
    )


def integer(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer variable (``4096``, ``1_000_000``, or an integral float such as ``1e6``), within bounds."""
    value = text(name)
    if value is None:
        return default
    expected = _bounds("an integer", minimum, maximum)
    try:
        parsed = int(value)
    except ValueError:
        try:
            as_float = float(value)
        except ValueError:
            raise EnvironmentVariableError(name, value, expected) from None
        if not math.isfinite(as_float) or not as_float.is_integer():
            raise EnvironmentVariableError(name, value, expected) from None
        parsed = int(as_float)
    if (minimum is not None and parsed < minimum) or (maximum is not None and parsed > maximum):
        raise EnvironmentVariableError(name, value, expected)
    return parsed


def number(
    name: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
) -> float:
    """A finite real variable (``2.5``, ``1e-3``), within bounds (``positive``: strictly above 0)."""
    value = text(name)
    if value is None:
        return default
    expected = "a finite number > 0" if positive else _bounds("a finite number", minimum, maximum)
    if positive and maximum is not None:
        expected += f" and <= {maximum}"
    try:
        parsed = float(value)
    except ValueError:
        raise EnvironmentVariableError(name, value, expected) from None
    if (
        not math.isfinite(parsed)
        or (positive and parsed <= 0)
        or (minimum is not None and parsed < minimum)
        or (maximum is not None and parsed > maximum)
    ):
        raise EnvironmentVariableError(name, value, expected)
    return parsed


def choice(name: str, default: str, choices: Iterable[str]) -> str:
    """One of ``choices`` (compared in lower case), or ``default`` when unset."""
    options = tuple(choices)
    value = text(name)
    if value is None:
        return default
    if value.lower() not in options:
        raise EnvironmentVariableError(name, value, "one of " + ", ".join(options))
    return value.lower()


#: What one item of a :func:`name_list` may hold: an entry point or distribution name.
NAME_CHARACTERS = "letters, digits, '_', '.' and '-'"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def name_list(name: str) -> frozenset[str]:
    """A comma-separated list of names (``a,b``) made of :data:`NAME_CHARACTERS`; empty items are ignored.

    Blanks around an item are ignored; another separator (``a;b``, ``a b``) raises rather than reading as
    one name that matches nothing.
    """
    raw = os.environ.get(name, "")
    items = frozenset(part.strip() for part in raw.split(",") if part.strip())
    if not all(_NAME.fullmatch(item) for item in items):
        raise EnvironmentVariableError(name, raw.strip(),
                                       f"a comma-separated list of names made of {NAME_CHARACTERS} (e.g. a,b-c)")
    return items


def _bounds(kind: str, minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f"{kind} from {minimum} to {maximum}"
    if minimum is not None:
        return f"{kind} >= {minimum}"
    if maximum is not None:
        return f"{kind} <= {maximum}"
    return kind
