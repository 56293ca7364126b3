"""The tensor-core weight layout: a ``QuantizedWeight`` repacked once for ``quant_gemm_tc.cu``.

The portable format (``hal_core.quant``) stays the interchange format; this is
a backend-specific preparation, built on first use from the portable arrays
(array-module generic: numpy for the host-compiled tests, CuPy on the device;
integer bit operations only, never a float copy of the weight) and cached per
weight object in a bounded cache.

Layout (``npad = ceil(N / 128) * 128``; columns past N are zero codes with scale 0):

- ``qtc``: for each 32-row k-block ``kb`` and 32-column group ``cg``, 32 lane
  records (lane = 4 * groupID + threadID_in_group, as in the PTX fragment
  tables), then within a record one entry per 8-column MMA tile ``j``
  (column ``n = 32 cg + 8 j + groupID``):

  - int4: one uint32 word (16-byte record).  Nibble ``p`` (p = 0..3) holds row
    ``k = 32 kb + 16 (p // 2) + 8 (p % 2) + 2 t`` and nibble ``p + 4`` row ``k + 1``,
    so the word's pairs (p, p + 4) are, in order, the B registers of the two
    m16n8k16 steps of the k-block.
  - int8: two uint32 words (32-byte record), the m16n8k32 B registers: byte ``b`` of
    word ``i`` holds row ``k = 32 kb + 16 i + 4 t + b`` as the int8 ``q - 128``.
- ``scales``: fp16 ``[K / G, npad]``; ``zeros``: uint8 ``[K / G, npad]`` or None.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["COLS_PER_CTA", "K_BLOCK", "PackedWeight", "PackedWeightCache", "pack_weight", "padded_columns"]

#: Output columns per CTA of quant_gemm_tc.cu (the padding unit of N).
COLS_PER_CTA = 128
#: Rows of K per pipeline stage (K must be a multiple).
K_BLOCK = 32


def padded_columns(n: int) -> int:
    """N rounded up to a multiple of :data:`COLS_PER_CTA`."""
    return -(-n // COLS_PER_CTA) * COLS_PER_CTA


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the tensor-core layout (see the module docs); ``nbytes`` counts every array."""

    qtc: Any
    scales: Any
    zeros: Any | None
    bits: int
    group_size: int
    shape: tuple[int, int]

    @property
    def npad(self) -> int:
        return padded_columns(self.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.qtc.nbytes + self.scales.nbytes + (self.zeros.nbytes if self.zeros is not None else 0))


def _pad_columns(xp: Any, a: Any, npad: int) -> Any:
    out = xp.zeros((a.shape[0], npad), dtype=a.dtype)
    out[:, : a.shape[1]] = a
    return out


def pack_weight(qw: Any, xp: Any = np) -> PackedWeight:
    """Repack ``qw`` (a ``QuantizedWeight`` with fp16 scales, arrays of module ``xp``) into the tensor-core layout."""
    k, n = qw.shape
    if k % K_BLOCK or qw.group_size % K_BLOCK:
        raise ValueError(f"the tensor-core layout needs K and group_size multiples of {K_BLOCK}, got K={k}, "
                         f"group_size={qw.group_size}")
    if qw.g_idx is not None:
        raise ValueError("act-order weights (g_idx) have no tensor-core layout")
    npad = padded_columns(n)
    kb, cg = k // K_BLOCK, npad // 32
    if qw.bits == 4:
        packed = xp.asarray(qw.qweight).astype(np.uint32)
        shifts = (4 * xp.arange(8, dtype=np.uint32))[None, :, None]
        codes = ((packed[:, None, :] >> shifts) & np.uint32(0xF)).reshape(k, n)
        codes = _pad_columns(xp, codes, npad)
        # k = 32 kb + 16 s + 8 r + 2 t + e;  n = 32 cg + 8 j + g
        c = codes.reshape(kb, 2, 2, 4, 2, cg, 4, 8).transpose(0, 5, 7, 3, 6, 1, 2, 4)  # kb cg g t j s r e
        nibble = (2 * xp.arange(2)[:, None, None] + xp.arange(2)[None, :, None]
                  + 4 * xp.arange(2)[None, None, :]).astype(np.uint32)  # [s, r, e] -> 2 s + r + 4 e
        words = (c << (4 * nibble)).sum(axis=(5, 6, 7), dtype=np.uint32)  # kb cg g t j
        qtc = xp.ascontiguousarray(words.reshape(kb, npad * 4).astype(np.uint32))
    elif qw.bits == 8:
        codes = _pad_columns(xp, xp.asarray(qw.qweight).astype(np.uint8), npad) ^ np.uint8(0x80)  # int8 q - 128
        # k = 32 kb + 16 i + 4 t + b;  n = 32 cg + 8 j + g
        c = codes.reshape(kb, 2, 4, 4, cg, 4, 8).transpose(0, 4, 6, 2, 5, 1, 3)  # kb cg g t j i b
        qtc = xp.ascontiguousarray(c).reshape(kb, npad * 32).view(np.uint32)
    else:
        raise ValueError(f"bits must be 4 or 8, got {qw.bits}")
    scales = _pad_columns(xp, xp.asarray(qw.scales), npad)
    if scales.dtype != np.float16:
        raise ValueError(f"the tensor-core kernels read float16 scales, got {scales.dtype}")
    zeros = None if qw.zeros is None else _pad_columns(xp, xp.asarray(qw.zeros).astype(np.uint8), npad)
    return PackedWeight(qtc, scales, zeros, qw.bits, qw.group_size, (k, n))


class PackedWeightCache:
    """Packed forms of the weights seen, keyed by weight object (identity), least recently used out first.

    Bounded by ``max_bytes`` of packed data; an entry also goes when its
    ``QuantizedWeight`` is garbage-collected.  A weight whose arrays were
    swapped (a new ``QuantizedWeight``) is a new key, so an entry never
    outlives the arrays it was packed from.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, Any], tuple[weakref.ref, tuple[int, ...], PackedWeight]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _fingerprint(qw: Any) -> tuple[int, ...]:
        return tuple(id(a) for a in (qw.qweight, qw.scales, qw.zeros))

    def get(self, qw: Any, key_extra: Any, build: Any) -> PackedWeight:
        """The packed form of ``qw`` (for ``key_extra``, e.g. the device), building it with ``build()`` on a miss."""
        key = (id(qw), key_extra)
        with self._lock:
            found = self._entries.get(key)
            if found is not None and found[0]() is qw and found[1] == self._fingerprint(qw):
                self._entries.move_to_end(key)
                return found[2]
        packed = build()
        with self._lock:
            self._drop(key)
            if packed.nbytes <= self.max_bytes:
                def evict(_ref: weakref.ReferenceType[Any], k: Any = key) -> None:
                    self._evict(k)

                self._entries[key] = (weakref.ref(qw, evict), self._fingerprint(qw), packed)
                self._bytes += packed.nbytes
                while self._bytes > self.max_bytes:
                    self._drop(next(iter(self._entries)))
        return packed

    def _drop(self, key: tuple[int, Any]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[2].nbytes

    def _evict(self, key: tuple[int, Any]) -> None:
        with self._lock:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
