"""Version of the hal-cpu distribution (the one place it is kept)."""

from __future__ import annotations

__version__ = "0.1.0"
