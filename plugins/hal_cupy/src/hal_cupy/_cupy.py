"""The one place hal-cuda imports CuPy, lazily (never at plugin import)."""

from __future__ import annotations

from typing import Any

__all__ = ["cupy"]


def cupy() -> Any:
    """The ``cupy`` module, imported on first use (tests may monkeypatch this function)."""
    import cupy as module

    return module
