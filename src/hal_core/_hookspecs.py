"""The hook specification plugins implement (entry-point group ``hal``).

A plugin is a module named by an entry point in the ``hal`` group. It
declares the HAL API version it was written for and the backend classes it
provides::

    from hal_core import hookimpl

    @hookimpl
    def hal_api_version():
        return (1, 0)  # the version this plugin was written against, not hal_core.API_VERSION

    @hookimpl
    def hal_backends():
        return [MyBackend]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ._backend import Backend
    from .ops import OpImpl

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

#: The pluggy project name and the entry-point group plugins register in.
PROJECT_NAME = "hal"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec(firstresult=True)
def hal_api_version() -> tuple[int, int]:
    """The HAL API version ``(major, minor)`` the plugin implements.

    Checked before any other hook of the plugin runs: a different major, or
    a minor newer than hal-core's, refuses the plugin.

    :returns: a ``(major, minor)`` tuple of ints.

    .. versionadded:: 1.0
    """


@hookspec
def hal_backends() -> list[type[Backend]]:
    """Backend classes the plugin provides.

    :returns: a list of :class:`hal_core.Backend` subclasses (not instances).

    .. versionadded:: 1.0
    """


@hookspec
def hal_extra_ops(backend: Backend) -> list[OpImpl]:
    """Op implementations this plugin adds to a backend it may not own.

    Called once for each backend when it is bound.

    :param backend: the bound :class:`hal_core.Backend` instance.
    :returns: a list of :class:`hal_core.ops.OpImpl` (empty when none apply).

    .. versionadded:: 1.0
    """
