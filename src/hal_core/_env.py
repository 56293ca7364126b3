"""The ``HAL_*`` environment variables, read in one place (see docs/environment.md)."""

from __future__ import annotations

import os

__all__ = [
    "allowed_overrides",
    "backend_override",
    "check_indices",
    "disabled_plugins",
    "force_cpu",
    "probe_timeout_s",
    "strict",
]

_TRUE = {"1", "true", "yes", "on"}


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() in _TRUE


def backend_override() -> str | None:
    """``HAL_BACKEND``: the backend ``get_backend()`` picks when given no name."""
    value = os.environ.get("HAL_BACKEND", "").strip()
    return value or None


def force_cpu() -> bool:
    """``HAL_FORCE_CPU=1``: keep the chosen backend initialised but run every op on the CPU path."""
    return _flag("HAL_FORCE_CPU")


def strict() -> bool:
    """``HAL_STRICT=1``: every fallback raises :class:`~hal_core.FallbackError` instead."""
    return _flag("HAL_STRICT")


def check_indices() -> bool:
    """``HAL_CHECK_INDICES=0`` skips the value checks of block tables, lengths and slots."""
    return _flag("HAL_CHECK_INDICES", default=True)


def disabled_plugins() -> frozenset[str]:
    """``HAL_DISABLE_PLUGINS=a,b``: entry points never imported."""
    raw = os.environ.get("HAL_DISABLE_PLUGINS", "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def allowed_overrides() -> frozenset[str]:
    """``HAL_ALLOW_OVERRIDE=dist-a,dist-b``: distributions allowed to replace or extend another's backend."""
    raw = os.environ.get("HAL_ALLOW_OVERRIDE", "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


#: Seconds ``HAL_PROBE_TIMEOUT_S`` defaults to.
PROBE_TIMEOUT_DEFAULT_S = 10.0


def probe_timeout_s() -> float:
    """``HAL_PROBE_TIMEOUT_S``: seconds one backend's ``availability()`` may take (default 10)."""
    raw = os.environ.get("HAL_PROBE_TIMEOUT_S", "").strip()
    if not raw:
        return PROBE_TIMEOUT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"HAL_PROBE_TIMEOUT_S={raw!r}: expected a number of seconds > 0") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"HAL_PROBE_TIMEOUT_S={raw!r}: expected a number of seconds > 0")
    return value
