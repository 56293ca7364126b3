"""The ``HAL_*`` variables hal-core reads, in one place (see docs/environment.md).

Every value goes through :mod:`hal_core.env`, the parser plugins use too.
"""

from __future__ import annotations

from . import env

__all__ = [
    "allowed_overrides",
    "backend_override",
    "check_indices",
    "disabled_plugins",
    "force_cpu",
    "probe_timeout_s",
    "strict",
]


def backend_override() -> str | None:
    """``HAL_BACKEND``: the backend ``get_backend()`` picks when given no name."""
    return env.text("HAL_BACKEND")


def force_cpu() -> bool:
    """``HAL_FORCE_CPU=1``: keep the chosen backend initialised but run every op on the CPU path."""
    return env.flag("HAL_FORCE_CPU", default=False)


def strict() -> bool:
    """``HAL_STRICT=1``: every fallback raises :class:`~hal_core.FallbackError` instead."""
    return env.flag("HAL_STRICT", default=False)


def check_indices() -> bool:
    """``HAL_CHECK_INDICES=0`` skips the host value checks of host block tables, lengths and slots.

    Device index arrays are checked by the kernels either way (:func:`hal_core.check_errors`).
    """
    return env.flag("HAL_CHECK_INDICES", default=True)


def disabled_plugins() -> frozenset[str]:
    """``HAL_DISABLE_PLUGINS=a,b``: entry points never imported."""
    return env.name_list("HAL_DISABLE_PLUGINS")


def allowed_overrides() -> frozenset[str]:
    """``HAL_ALLOW_OVERRIDE=dist-a,dist-b``: distributions allowed to replace or extend another's backend."""
    return env.name_list("HAL_ALLOW_OVERRIDE")


#: Seconds ``HAL_PROBE_TIMEOUT_S`` defaults to.
PROBE_TIMEOUT_DEFAULT_S = 10.0


def probe_timeout_s() -> float:
    """``HAL_PROBE_TIMEOUT_S``: seconds one backend's ``availability()`` may take (default 10)."""
    return env.number("HAL_PROBE_TIMEOUT_S", PROBE_TIMEOUT_DEFAULT_S, positive=True)
