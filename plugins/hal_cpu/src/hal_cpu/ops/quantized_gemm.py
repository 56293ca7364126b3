"""``quantized_gemm`` on the host.

- W4A16: the weight is dequantised to float32 (vectorised unpack; exact,
  since ``(q - z) * s`` of a 4-bit code and an fp16 scale fits float32's
  mantissa) and multiplied with BLAS in float32. Dequantised weights are
  kept in a small LRU cache keyed by the :class:`~hal_core.quant.QuantizedWeight`
  object (dropped when the object is collected), at most
  :data:`DEQUANT_CACHE_BYTES` in all, so a model's weights are not all
  expanded at once (entries are keyed by the object and by what they hold).
  The cache assumes weights are not modified in place;
  call :func:`clear_dequant_cache` if they are.
- W8A8: activations are quantised per token with
  :func:`~hal_core.quant.quantize_activations`; each group's integer dot
  products are accumulated exactly (float32 BLAS while
  ``G * 127 * 255 < 2**24``, else float64), then scaled by the group
  scales and the token scales, as the reference does. The centred codes
  ``q - z`` are cached like the int4 weights.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque

import numpy as np

from hal_core.ops import OpCall
from hal_core.quant import QuantizedWeight, quantize_activations, unpack_int4

from ._common import finish
from .paged_attention import to_float32

__all__ = ["DEQUANT_CACHE_BYTES", "clear_dequant_cache", "dequantize_float32", "quantized_gemm",
           "set_dequant_cache_limit"]

#: Default byte budget of the dequantised-weight cache.
DEQUANT_CACHE_BYTES = 256 * 1024 * 1024
#: Bytes of per-group partial sums one W8A8 chunk of rows may hold.
W8A8_CHUNK_BYTES = 64 * 1024 * 1024
_EXACT_FLOAT32 = 2**24


class _DequantCache:
    """LRU of arrays derived from a QuantizedWeight, keyed by ``(id(weight), kind)``; entries die with their weight.

    ``kind`` tells apart the different arrays one weight yields (the float32
    weight, the centred codes of a given dtype). The weakref callbacks that
    drop dead entries may run at any allocation (garbage collection), even
    while this thread holds the lock, so they only queue the key; the queue
    is drained under the lock by the next :meth:`get` or :meth:`put`.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, str], tuple[weakref.ref[QuantizedWeight], np.ndarray]] = OrderedDict()
        self._dead: deque[tuple[int, str]] = deque()  # appended by weakref callbacks, without the lock
        self._bytes = 0

    def get(self, qweight: QuantizedWeight, kind: str) -> np.ndarray | None:
        key = (id(qweight), kind)
        with self._lock:
            self._drain()
            entry = self._entries.get(key)
            if entry is None or entry[0]() is not qweight:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, qweight: QuantizedWeight, kind: str, array: np.ndarray) -> None:
        if array.nbytes > self.limit:
            return
        key = (id(qweight), kind)
        ref = weakref.ref(qweight, lambda _, key=key: self._dead.append(key))
        with self._lock:
            self._drain()
            self._pop(key)
            self._entries[key] = (ref, array)
            self._bytes += array.nbytes
            while self._bytes > self.limit:
                self._pop(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._dead.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            self._drain()
            return self._bytes

    def _drain(self) -> None:
        """Drop the entries whose weight was collected (called with the lock held)."""
        while self._dead:
            key = self._dead.popleft()
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is None:  # not a newer weight that reuses the id
                self._pop(key)

    def _pop(self, key: tuple[int, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1].nbytes


_cache = _DequantCache(DEQUANT_CACHE_BYTES)


def set_dequant_cache_limit(nbytes: int) -> None:
    """Cap the dequantised-weight cache at ``nbytes`` (0 disables it)."""
    _cache.limit = int(nbytes)
    if nbytes <= 0:
        _cache.clear()


def clear_dequant_cache() -> None:
    """Forget every cached dequantised weight."""
    _cache.clear()


def _codes(qweight: QuantizedWeight) -> np.ndarray:
    packed = np.asarray(qweight.qweight)
    return unpack_int4(packed) if qweight.bits == 4 else packed


def _centered_codes(qweight: QuantizedWeight, dtype: type) -> np.ndarray:
    """``q - z`` as ``dtype`` ``[K, N]`` (small integers, exact)."""
    k, _ = qweight.shape
    codes = _codes(qweight).astype(dtype)
    if qweight.zeros is None:
        codes -= dtype(qweight.default_zero)
    elif qweight.g_idx is None:
        zeros = np.asarray(qweight.zeros).astype(dtype)
        groups = k // qweight.group_size
        codes.reshape(groups, qweight.group_size, -1)[...] -= zeros[:, None, :]
    else:
        codes -= np.asarray(qweight.zeros).astype(dtype)[np.asarray(qweight.g_idx)]
    return codes


def dequantize_float32(qweight: QuantizedWeight) -> np.ndarray:
    """The float32 weight ``[K, N]`` (cached; see the module docs)."""
    cached = _cache.get(qweight, "float32")
    if cached is not None:
        return cached
    k, n = qweight.shape
    weight = _centered_codes(qweight, np.float32)
    scales = to_float32(np.asarray(qweight.scales))
    if qweight.g_idx is None:
        weight.reshape(k // qweight.group_size, qweight.group_size, n)[...] *= scales[:, None, :]
    else:
        weight *= scales[np.asarray(qweight.g_idx)]
    weight.setflags(write=False)
    _cache.put(qweight, "float32", weight)
    return weight


def _centered_cached(qweight: QuantizedWeight, dtype: type) -> np.ndarray:
    """``q - z`` of an int8 weight (cached like the dequantised int4 weights)."""
    kind = f"centered-{np.dtype(dtype).name}"
    cached = _cache.get(qweight, kind)
    if cached is not None:
        return cached
    centered = _centered_codes(qweight, dtype)
    centered.setflags(write=False)
    _cache.put(qweight, kind, centered)
    return centered


def _w8a8(x: np.ndarray, qweight: QuantizedWeight) -> np.ndarray:
    k, n = qweight.shape
    xq, sx = quantize_activations(x)
    g = qweight.group_size
    exact_dtype = np.float32 if g * 127 * 255 < _EXACT_FLOAT32 else np.float64
    centered = _centered_cached(qweight, exact_dtype)
    if qweight.g_idx is not None:
        g_idx = np.asarray(qweight.g_idx).astype(np.int64)
        if not (np.bincount(g_idx, minlength=k // g) == g).all():
            # uneven act-order groups: one float64 product is exact enough (|terms| < 2**15)
            scales64 = np.asarray(qweight.scales).astype(np.float64)[g_idx]
            return sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ (centered * scales64))
        order = np.argsort(g_idx, kind="stable")
        xq, centered = xq[:, order], centered[order]
    groups = k // g
    m = x.shape[0]
    wg = centered.reshape(groups, g, n)
    scales = to_float32(np.asarray(qweight.scales)).astype(exact_dtype)
    y = np.empty((m, n), dtype=exact_dtype)
    rows = max(1, W8A8_CHUNK_BYTES // max(1, groups * n * 8))
    for r0 in range(0, m, rows):  # chunks of rows bound the [groups, rows, N] partial sums
        # [groups, rows, G], contiguous so that matmul takes the BLAS path
        xg = np.ascontiguousarray(xq[r0:r0 + rows].astype(exact_dtype).reshape(-1, groups, g).transpose(1, 0, 2))
        partial = xg @ wg  # [groups, rows, N]: exact integer sums per group
        partial *= scales[:, None, :]
        partial.sum(axis=0, out=y[r0:r0 + rows])
    y *= sx.astype(exact_dtype)[:, None]
    return y


def quantized_gemm(call: OpCall) -> np.ndarray:
    """The registered implementation for int4 (W4A16) and int8 (W8A8) weights."""
    x = np.asarray(call["x"])
    qweight: QuantizedWeight = call["qweight"]
    result = _w8a8(x, qweight) if qweight.bits == 8 else to_float32(x) @ dequantize_float32(qweight)
    return finish(call, result)
