"""``QuantizedWeight``: group-wise quantized ``[K, N]`` weights and their packing.

Storage (documented in docs/quantization.md):

- ``bits=4``: ``qweight`` uint32 ``[K // 8, N]``; bits ``4j..4j+3`` of word
  ``[r, n]`` hold the unsigned code ``q[8r + j, n]`` in ``0..15``.
- ``bits=8``: ``qweight`` uint8 ``[K, N]``, unsigned codes ``0..255``.
- ``scales`` ``[K // G, N]`` (float16 by default).
- ``zeros`` uint8 ``[K // G, N]`` or None; None means the symmetric zero
  point ``2 ** (bits - 1)`` (8 for int4, 128 for int8).
- ``g_idx`` int32 ``[K]`` or None: the group of each row (act-order
  checkpoints); None means ``k // G``.

Dequantisation: ``w[k, n] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g = g_idx[k]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from ..arrays import DLPACK_HOST_TYPES, device_of, dlpack_device
from ._args import as_int

__all__ = ["QuantizedWeight", "pack_int4", "unpack_int4"]


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack codes ``[K, N]`` in 0..15 into uint32 ``[K // 8, N]``, eight rows per word."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[0] % 8:
        raise ValueError(f"pack_int4: expected [K, N] codes with K divisible by 8, got shape {q.shape}")
    if q.size and (q.min() < 0 or q.max() > 15):
        raise ValueError("pack_int4: codes must lie in 0..15")
    rows = q.astype(np.uint32).reshape(q.shape[0] // 8, 8, q.shape[1])
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, :, None]
    return np.bitwise_or.reduce(rows << shifts, axis=1).astype(np.uint32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_int4`: uint32 ``[K // 8, N]`` to uint8 codes ``[K, N]``."""
    packed = np.asarray(packed, dtype=np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, :, None]
    codes = (packed[:, None, :] >> shifts) & np.uint32(0xF)
    return codes.reshape(packed.shape[0] * 8, packed.shape[1]).astype(np.uint8)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """Group-wise quantized weights of logical shape ``[K, N]`` (see the module docs).

    Arrays may live in any backend's memory domain; :meth:`map_arrays`
    moves them (``qw.map_arrays(backend.asarray)``).
    """

    qweight: Any
    scales: Any
    zeros: Any | None
    bits: int
    group_size: int
    shape: tuple[int, int]
    g_idx: Any | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", as_int("bits", self.bits))
        object.__setattr__(self, "group_size", as_int("group_size", self.group_size))
        try:
            shape = tuple(as_int("shape", d) for d in self.shape)
        except TypeError:
            raise TypeError(f"QuantizedWeight: shape must be two integers (K, N), got {self.shape!r}") from None
        if len(shape) != 2 or min(shape) < 0:
            raise ValueError(f"QuantizedWeight: shape must be two integers (K, N) >= 0, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if self.bits not in (4, 8):
            raise ValueError(f"QuantizedWeight: bits must be 4 or 8, got {self.bits}")
        k, n = self.shape
        g = self.group_size
        if g <= 0 or k % g:
            raise ValueError(f"QuantizedWeight: K={k} must be divisible by group_size={g}")
        packed = (k // 8, n) if self.bits == 4 else (k, n)
        if tuple(self.qweight.shape) != packed:
            raise ValueError(f"QuantizedWeight: qweight must have shape {packed}, got {tuple(self.qweight.shape)}")
        if tuple(self.scales.shape) != (k // g, n):
            raise ValueError(f"QuantizedWeight: scales must have shape {(k // g, n)}, got {tuple(self.scales.shape)}")
        if self.zeros is not None and tuple(self.zeros.shape) != (k // g, n):
            raise ValueError(f"QuantizedWeight: zeros must have shape {(k // g, n)}, got {tuple(self.zeros.shape)}")
        if self.g_idx is not None and tuple(self.g_idx.shape) != (k,):
            raise ValueError(f"QuantizedWeight: g_idx must have shape {(k,)}, got {tuple(self.g_idx.shape)}")

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def out_features(self) -> int:
        return self.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def default_zero(self) -> int:
        """The zero point used when :attr:`zeros` is None."""
        return 1 << (self.bits - 1)

    @property
    def nbytes(self) -> int:
        total = 0
        for value in (self.qweight, self.scales, self.zeros, self.g_idx):
            if type(value) is np.ndarray:
                total += value.nbytes
            elif value is not None:
                total += int(math.prod(value.shape)) * value.dtype.itemsize
        return total

    def arrays(self) -> dict[str, Any]:
        """The array fields by name (None ones omitted)."""
        names = ("qweight", "scales", "zeros", "g_idx")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def map_arrays(self, fn: Callable[[Any], Any]) -> QuantizedWeight:
        """A copy with ``fn`` applied to every array field (e.g. to move it to a device)."""
        return replace(self, **{name: fn(value) for name, value in self.arrays().items()})

    def codes(self) -> np.ndarray:
        """The unsigned integer codes ``q`` as uint8 ``[K, N]`` (host numpy)."""
        qweight = _host(self.qweight)
        return unpack_int4(qweight) if self.bits == 4 else qweight.astype(np.uint8)

    def group_index(self) -> np.ndarray:
        """The group of each row: ``g_idx``, or ``k // group_size``."""
        if self.g_idx is not None:
            return _host(self.g_idx).astype(np.int64)
        return np.arange(self.shape[0]) // self.group_size

    def dequantize(self, dtype: Any = np.float64) -> np.ndarray:
        """The float weights ``[K, N]`` as host numpy, computed in float64, cast to ``dtype``."""
        groups = self.group_index()
        scales = _host(self.scales).astype(np.float64)[groups]
        zeros = float(self.default_zero) if self.zeros is None else _host(self.zeros).astype(np.float64)[groups]
        return ((self.codes().astype(np.float64) - zeros) * scales).astype(dtype)

    def __repr__(self) -> str:
        kind = "symmetric" if self.symmetric else "with zero points"
        return (f"QuantizedWeight(int{self.bits}, shape={self.shape}, group_size={self.group_size}, "
                f"{kind}{', act-order' if self.g_idx is not None else ''})")

    def __eq__(self, other: object) -> bool:  # arrays compare by value
        if not isinstance(other, QuantizedWeight):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if hasattr(a, "shape") or hasattr(b, "shape"):
                if (a is None) != (b is None) or (a is not None and not np.array_equal(_host(a), _host(b))):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


def _host(array: Any) -> np.ndarray:
    """A host view of one of the weight's arrays; device arrays must be brought over by their backend."""
    if isinstance(array, np.ndarray):
        return array
    found = dlpack_device(array)
    if found is None:
        return np.asarray(array)
    if found[0] in DLPACK_HOST_TYPES and hasattr(array, "__dlpack__"):
        return np.from_dlpack(array)
    raise TypeError(
        f"this QuantizedWeight holds {type(array).__name__} arrays on {device_of(array)}; bring it to the "
        f"host first with weight.map_arrays(backend.to_numpy)"
    )
