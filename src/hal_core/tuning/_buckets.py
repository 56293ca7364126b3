"""Shape buckets: the classes of calls one tuned choice covers.

Each op defines its buckets (:meth:`hal_core.ops.OpSpec.bucket`): a short string computed from
shapes only (never from device data, so no device-to-host copy), usually from powers of two of a
few sizes (:func:`pow2`).
"""

from __future__ import annotations

__all__ = ["pow2"]


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
