"""Import AWQ checkpoint tensors into :class:`~hal_core.quant.QuantizedWeight`.

AWQ (AutoAWQ's GEMM layout, as stored by ``transformers``), for a linear
layer with ``K`` input and ``N`` output features, 4 bits, group size ``G``:

- ``qweight`` int32 ``[K, N / 8]``, packed along N: nibble ``i`` (bits
  ``4i .. 4i+3``) of word ``[k, c]`` holds column ``8c + AWQ_ORDER[i]`` with
  ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (interleaved for the kernel's
  fast int4-to-fp16 conversion);
- ``qzeros`` int32 ``[K / G, N / 8]``, packed the same way; the stored value
  *is* the zero point (no offset, unlike GPTQ v1);
- ``scales`` float16 ``[K / G, N]``.

``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``. AWQ has no act-order.
The words are unpacked and repacked along K into hal's layout: an offline,
host-side copy (numpy arrays, or torch tensors via ``.numpy()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._args import as_bool
from ._weight import QuantizedWeight
from .gptq import build, group_scales, host_int32, require_layer, unpack_cols, zero_words

__all__ = ["AWQ_ORDER", "from_awq"]

#: Column (within a group of 8) held by nibble ``i`` of an AWQ word.
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])


def from_awq(qweight: Any, qzeros: Any, scales: Any, *, symmetric: bool | None = None) -> QuantizedWeight:
    """A :class:`QuantizedWeight` from one AWQ layer's tensors (see the module docs).

    ``symmetric=None`` drops the zero points when they are all 8 (hal's
    symmetric default); ``True`` requires that; ``False`` keeps them.
    """
    symmetric = as_bool("symmetric", symmetric, allow_none=True)
    words = host_int32("qweight", qweight, ndim=2)
    k, n = words.shape[0], words.shape[1] * 8  # every shape is checked before any word is unpacked
    require_layer("qweight", k, n, "[K, N/8]")
    if k % 8:
        raise ValueError(f"argument 'qweight': K={k} rows ([K, N/8]); hal packs the codes of 8 rows per int32 "
                         f"word along K, so K must be a multiple of 8")
    scales = group_scales(scales, k, n)
    packed_zeros = zero_words(qzeros, scales.shape[0], n, 8)
    codes = unpack_cols(words, 4, AWQ_ORDER)  # [K, N]
    zeros = unpack_cols(packed_zeros, 4, AWQ_ORDER).astype(np.int64)
    return build(codes, zeros, scales, None, bits=4, symmetric=symmetric)
