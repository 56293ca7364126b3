"""Version of the hal-vllm distribution (the one place it is written)."""

from __future__ import annotations

__version__ = "0.1.0"
