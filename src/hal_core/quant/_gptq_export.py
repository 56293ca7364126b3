"""Export a :class:`~hal_core.quant.QuantizedWeight` as one GPTQ layer's tensors: the inverse of ``from_gptq``.

The layout is the one :mod:`hal_core.quant.gptq` documents (``b`` bits,
``p = 32 // b`` codes per int32 word, ``K`` input and ``N`` output features,
group size ``G``):

- ``qweight`` int32 ``[K / p, N]``: row ``p*r + j`` in bits ``b*j ..`` of word
  ``[r, n]``; for ``b = 4`` this is hal's own packing, returned as an int32
  view of the weight's words (no copy);
- ``qzeros`` int32 ``[K / G, N / p]``: column ``p*c + j`` in bits ``b*j ..`` of
  word ``[g, c]``, holding ``z - 1`` (``checkpoint_format="gptq"``, v1) or ``z``
  (``"gptq_v2"``), where ``z`` is the true zero point (``2 ** (b - 1)`` for a
  symmetric weight);
- ``scales`` float16 ``[K / G, N]``;
- ``g_idx`` int32 ``[K]``: the weight's ``g_idx``, or ``k // G`` without one.

``from_gptq(**to_gptq(w), bits=w.bits, checkpoint_format=f)`` gives back ``w``
value for value, with two differences of form: bfloat16 or float32 scales
come back as float16 (they are converted only when every value is exact in
float16), and a ``g_idx`` equal to ``k // G`` or zero points all equal to
``2 ** (b - 1)`` come back as None (``from_gptq`` drops them).

What GPTQ cannot hold is refused with ``ValueError`` before anything is
packed: a K or N that is not a multiple of ``p`` (8-bit needs ``K % 4 == 0``:
hal's int8 stores one code per byte, GPTQ four per word), zero points
outside the format's range (v1 holds ``1 .. 2**b``: a zero point of 0, which
hal's asymmetric quantizer and AWQ checkpoints can have, needs ``gptq_v2``;
v2 holds ``0 .. 2**b - 1``), scales that are not exact in float16, and an
act-order ``g_idx`` whose groups do not each hold exactly ``G`` rows (GPTQ
kernels sort the rows by group and read ``G`` rows per group).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._weight import QuantizedWeight, _host
from .gptq import _OFFSETS

__all__ = ["check_gptq", "to_gptq"]


def _format_offset(checkpoint_format: Any) -> int:
    if not isinstance(checkpoint_format, str):
        raise TypeError(f"argument 'checkpoint_format': expected a string, got {type(checkpoint_format).__name__}")
    if checkpoint_format not in _OFFSETS:
        raise ValueError(f"argument 'checkpoint_format': expected one of {sorted(_OFFSETS)}, "
                         f"got {checkpoint_format!r}")
    return _OFFSETS[checkpoint_format]


def _stored_zeros(weight: QuantizedWeight, offset: int, checkpoint_format: str) -> np.ndarray:
    """The zero points as the checkpoint stores them (``z - offset``), each checked to fit ``bits`` bits."""
    k, n = weight.shape
    groups = k // weight.group_size
    if weight.zeros is None:
        return np.full((groups, n), weight.default_zero - offset, dtype=np.int64)
    stored = _host(weight.zeros).astype(np.int64) - offset
    top = (1 << weight.bits) - 1
    bad = (stored < 0) | (stored > top)
    if bad.any():
        g, col = (int(i) for i in np.argwhere(bad)[0])
        hint = ("; 'gptq_v2' stores the zero point itself (0 .. {top})" if offset else
                "; 'gptq' (v1) stores z - 1 (1 .. {limit})").format(top=top, limit=top + 1)
        raise ValueError(f"zero point {int(stored[g, col]) + offset} (group {g}, column {col}) does not fit "
                         f"checkpoint_format={checkpoint_format!r}, which holds true zero points "
                         f"{offset} .. {top + offset} in {weight.bits} bits{hint}")
    return stored


def _scales16(weight: QuantizedWeight) -> np.ndarray:
    """The scales as float16, converted only where every value is exact in float16."""
    scales = _host(weight.scales)
    if scales.dtype == np.float16:
        return scales
    wide = scales.astype(np.float64)
    narrow = wide.astype(np.float16)
    inexact = narrow.astype(np.float64) != wide
    if inexact.any():
        g, col = (int(i) for i in np.argwhere(inexact)[0])
        raise ValueError(f"GPTQ stores float16 scales; this weight's {scales.dtype} scale {wide[g, col]!r} "
                         f"(group {g}, column {col}) is not exact in float16 (quantize with "
                         f"scale_dtype float16)")
    return narrow


def _g_idx(weight: QuantizedWeight) -> np.ndarray:
    """``g_idx`` as int32 ``[K]`` (``k // G`` when the weight has none); act-order groups must hold G rows each."""
    k = weight.shape[0]
    if weight.g_idx is None:
        return (np.arange(k, dtype=np.int32) // weight.group_size).astype(np.int32)
    g_idx = _host(weight.g_idx).astype(np.int32)
    counts = np.bincount(g_idx.astype(np.int64), minlength=k // weight.group_size)
    uneven = np.flatnonzero(counts != weight.group_size)
    if uneven.size:
        g = int(uneven[0])
        raise ValueError(f"g_idx puts {int(counts[g])} rows in group {g}; GPTQ's act-order groups hold exactly "
                         f"group_size={weight.group_size} rows each")
    return g_idx


def check_gptq(weight: QuantizedWeight, checkpoint_format: str = "gptq") -> None:
    """Raise ``ValueError`` (``TypeError`` for a non-weight) if GPTQ cannot hold ``weight`` exactly; pack nothing."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"argument 'weight': expected a hal_core.quant.QuantizedWeight, got {type(weight).__name__}")
    offset = _format_offset(checkpoint_format)
    k, n = weight.shape
    per_word = 32 // weight.bits
    if k % per_word or n % per_word:
        raise ValueError(f"a {k} -> {n} int{weight.bits} weight: GPTQ packs {per_word} codes per int32 word along "
                         f"K (qweight) and {per_word} zero points along N (qzeros), so K and N must be multiples "
                         f"of {per_word}")
    _stored_zeros(weight, offset, checkpoint_format)
    _scales16(weight)
    _g_idx(weight)


def _pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes ``[K, N]`` to uint32 ``[K / p, N]``: row ``p*r + j`` in slot ``j`` (one slot at a time)."""
    per_word = 32 // bits
    words = np.zeros((codes.shape[0] // per_word, codes.shape[1]), dtype=np.uint32)
    slot = np.empty_like(words)  # reused: the transient stays one more array of the words' size
    for j in range(per_word):
        np.copyto(slot, codes[j::per_word])
        slot <<= np.uint32(bits * j)
        words |= slot
    return words


def _pack_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """Values ``[R, C]`` (each below ``2**bits``) to uint32 ``[R, C / p]``: column ``p*c + j`` in slot ``j``."""
    per_word = 32 // bits
    slots = values.astype(np.uint32).reshape(values.shape[0], values.shape[1] // per_word, per_word)
    shifts = (bits * np.arange(per_word, dtype=np.uint32))[None, None, :]
    return np.bitwise_or.reduce(slots << shifts, axis=2).astype(np.uint32)


def to_gptq(weight: QuantizedWeight, *, checkpoint_format: str = "gptq") -> dict[str, np.ndarray]:
    """One GPTQ layer's ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` (host numpy) for ``weight``.

    ``checkpoint_format``: ``"gptq"`` (v1, what GPTQ readers expect by
    default) or ``"gptq_v2"``. The exact inverse of
    :func:`~hal_core.quant.from_gptq` (see the module docs for the two
    differences of form); ``ValueError`` when GPTQ cannot hold the weight
    (:func:`check_gptq`). The weight's arrays must be on the host
    (``weight.map_arrays(backend.to_numpy)``). The int4 ``qweight`` is a view
    of the weight's words; the int8 one is packed anew (one layer's bytes).
    """
    check_gptq(weight, checkpoint_format)
    stored = _stored_zeros(weight, _format_offset(checkpoint_format), checkpoint_format)
    qweight = _host(weight.qweight)
    if weight.bits == 4:
        words = np.ascontiguousarray(qweight).view(np.uint32)
    else:
        words = _pack_rows(qweight.astype(np.uint8, copy=False), weight.bits)
    return {
        "qweight": words.view(np.int32),
        "qzeros": _pack_cols(stored, weight.bits).view(np.int32),
        "scales": np.ascontiguousarray(_scales16(weight)),
        "g_idx": _g_idx(weight),
    }
