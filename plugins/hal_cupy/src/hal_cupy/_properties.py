"""Helpers for reading CuPy's device-property dictionaries, shared by the vendor plugins' capability mappings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ddr_bandwidth_gbps", "property_text"]


def property_text(raw: Any) -> str:
    """A property that CuPy returns as NUL-padded bytes (a device name, an arch name) as text."""
    return raw.decode(errors="replace").rstrip("\0") if isinstance(raw, bytes) else str(raw)


def ddr_bandwidth_gbps(props: Mapping[str, Any]) -> float | None:
    """``memoryClockRate`` (kHz) x 2 (double data rate) x ``memoryBusWidth`` (bits) / 8, in GB/s; None if unknown."""
    clock, width = props.get("memoryClockRate"), props.get("memoryBusWidth")
    if not clock or not width:
        return None
    return float(clock) * 1e3 * 2 * float(width) / 8 / 1e9
