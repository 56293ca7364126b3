"""Fixtures of the hal-rocm tests: nothing here touches a device, loads a HIP library or imports CuPy."""

from __future__ import annotations
