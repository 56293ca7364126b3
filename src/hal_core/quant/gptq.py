"""Import GPTQ checkpoint tensors into :class:`~hal_core.quant.QuantizedWeight`.

GPTQ (AutoGPTQ / GPTQModel, as stored by ``transformers``), for a linear
layer with ``K`` input and ``N`` output features, ``b`` bits (4 or 8), group
size ``G`` and ``p = 32 // b`` codes per int32 word:

- ``qweight`` int32 ``[K / p, N]``, packed along K: bits ``b*j .. b*j+b-1`` of
  word ``[r, n]`` hold the code of row ``p*r + j`` (for ``b = 4`` this is
  exactly hal's own packing, so the words are reused as they are);
- ``qzeros`` int32 ``[K / G, N / p]``, packed along N: bits ``b*j ..`` of word
  ``[g, c]`` hold the zero point of column ``p*c + j``;
- ``scales`` float16 ``[K / G, N]``;
- ``g_idx`` int32 ``[K]`` (optional): the group of each input row. With
  act-order (``desc_act=True``) it is a permutation-based assignment; without
  it the checkpoint stores the trivial ``k // G``, which is dropped here.

``w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``, where ``z`` is the
*true* zero point. The two on-disk formats differ only in ``z``:

- ``checkpoint_format="gptq"`` (v1, the default, what AutoGPTQ wrote and
  most published checkpoints hold): the stored nibble is ``z - 1``, so the
  true zero is ``stored + 1`` (a symmetric 4-bit layer stores 7 for a zero
  point of 8). v1 cannot represent a true zero of 0: it wraps to nibble 15
  and reads back as 16 (which hal's uint8 zeros hold).
- ``checkpoint_format="gptq_v2"`` (GPTQModel's internal format): the stored
  value is ``z`` itself.

``zero_point_offset`` overrides the format's offset (1 for v1, 0 for v2).
This is an offline conversion: inputs (numpy arrays, or torch tensors via
``.numpy()``) are copied into hal's layout on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import BFLOAT16, DLPACK_HOST_TYPES, device_of, dlpack_device
from ._args import as_bool, as_int, require_finite, require_integer_dtype
from ._weight import QuantizedWeight, pack_int4

__all__ = ["from_gptq"]

_OFFSETS = {"gptq": 1, "gptq_v1": 1, "gptq_v2": 0}


def from_gptq(
    qweight: Any,
    qzeros: Any,
    scales: Any,
    g_idx: Any | None = None,
    *,
    bits: int = 4,
    checkpoint_format: str = "gptq",
    zero_point_offset: int | None = None,
    symmetric: bool | None = None,
) -> QuantizedWeight:
    """A :class:`QuantizedWeight` from one GPTQ layer's tensors (see the module docs).

    ``symmetric=None`` stores no zero points when every true zero equals
    ``2 ** (bits - 1)`` (hal's symmetric default); ``True`` requires that;
    ``False`` always keeps them.
    """
    bits = as_int("bits", bits)
    if bits not in (4, 8):
        raise ValueError(f"argument 'bits': hal stores 4- or 8-bit weights, got {bits!r}")
    if not isinstance(checkpoint_format, str):
        raise TypeError(f"argument 'checkpoint_format': expected a string, got {type(checkpoint_format).__name__}")
    if checkpoint_format not in _OFFSETS:
        raise ValueError(f"argument 'checkpoint_format': expected one of {sorted(_OFFSETS)}, "
                         f"got {checkpoint_format!r}")
    offset = _OFFSETS[checkpoint_format] if zero_point_offset is None else as_int(
        "zero_point_offset", zero_point_offset)
    symmetric = as_bool("symmetric", symmetric, allow_none=True)
    per_word = 32 // bits
    words = host_int32("qweight", qweight, ndim=2)
    k, n = words.shape[0] * per_word, words.shape[1]  # every shape is checked before any word is unpacked
    require_layer("qweight", k, n, f"[K/{per_word}, N]")
    if n % per_word:
        raise ValueError(f"argument 'qweight': N={n} output features, but GPTQ packs {per_word} zero points "
                         f"per int32 word along N (qzeros [K/G, N/{per_word}]), so N must be a multiple of "
                         f"{per_word}")
    scales = group_scales(scales, k, n)
    num_groups = scales.shape[0]
    packed_zeros = zero_words(qzeros, num_groups, n, per_word)
    groups = None if g_idx is None else host_g_idx(g_idx, k, num_groups)
    zeros = unpack_cols(packed_zeros, bits).astype(np.int64) + offset
    if zeros.size and (zeros.min() < 0 or zeros.max() > 255):
        raise ValueError(f"argument 'qzeros': the true zero points (stored + {offset}) lie in "
                         f"{zeros.min()}..{zeros.max()}, hal stores 0..255; check checkpoint_format and "
                         f"zero_point_offset")
    return build(unpack_rows(words, bits), zeros, scales, groups, bits=bits, symmetric=symmetric)


# -- shared with awq.py ---------------------------------------------------------


def require_layer(name: str, k: int, n: int, layout: str) -> None:
    """Refuse an empty layer (no input or no output feature), naming the packed argument and its layout."""
    if k <= 0 or n <= 0:
        raise ValueError(f"argument {name!r}: a {layout} tensor of a layer with K={k} input and N={n} output "
                         f"features; both must be at least 1")


def group_scales(value: Any, k: int, n: int) -> np.ndarray:
    """Scales ``[K / G, N]`` on the host; their row count (the groups) must divide K."""
    scales = host_scales(value, n)
    num_groups = scales.shape[0]
    if num_groups == 0 or k % num_groups:
        raise ValueError(f"argument 'scales': {num_groups} groups do not divide K={k} (from qweight)")
    return scales


def zero_words(value: Any, num_groups: int, n: int, per_word: int) -> np.ndarray:
    """Packed zero points ``[K / G, N / per_word]`` on the host, shape checked."""
    words = host_int32("qzeros", value, ndim=2)
    if words.shape != (num_groups, n // per_word):
        raise ValueError(f"argument 'qzeros': expected shape {(num_groups, n // per_word)} "
                         f"([K/G, N/{per_word}]), got {words.shape}")
    return words


def host_numpy(name: str, value: Any) -> np.ndarray:
    """A host numpy copy (or view) of ``value``; torch tensors via ``.numpy()`` (bf16 via int16)."""
    module = type(value).__module__
    if module == "torch" or module.startswith("torch."):
        if not hasattr(value, "detach"):
            raise TypeError(f"argument {name!r}: expected an array, got {type(value).__name__}")
        if value.device.type == "meta":
            raise TypeError(f"argument {name!r}: a tensor on the meta device holds no values")
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import torch

            return tensor.view(torch.int16).numpy().view(BFLOAT16)
        return tensor.numpy()
    if not hasattr(value, "shape"):
        raise TypeError(f"argument {name!r}: expected an array, got {type(value).__name__}")
    if isinstance(value, np.ndarray):
        return value
    found = dlpack_device(value)
    if found is not None and found[0] not in DLPACK_HOST_TYPES:
        raise TypeError(f"argument {name!r}: a {type(value).__name__} on {device_of(value)}; checkpoints are "
                        f"imported from host arrays: pass backend.to_numpy({name}) (or a torch tensor)")
    if found is not None and hasattr(value, "__dlpack__"):
        return np.from_dlpack(value)
    return np.asarray(value)


def host_int32(name: str, value: Any, *, ndim: int) -> np.ndarray:
    """Packed words as uint32 (int32 checkpoints are reinterpreted, not converted)."""
    array = host_numpy(name, value)
    if array.dtype not in (np.int32, np.uint32):
        raise TypeError(f"argument {name!r}: expected int32 packed words, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"argument {name!r}: expected {ndim} dimensions, got shape {array.shape}")
    return np.ascontiguousarray(array).view(np.uint32)


def host_scales(value: Any, n: int) -> np.ndarray:
    scales = host_numpy("scales", value)
    if scales.dtype not in (np.float16, np.float32, BFLOAT16):
        raise TypeError(f"argument 'scales': expected float16, bfloat16 or float32, got {scales.dtype}")
    if scales.ndim != 2 or scales.shape[1] != n:
        raise ValueError(f"argument 'scales': expected shape [K/G, {n}], got {scales.shape}")
    require_finite("scales", scales)
    return np.ascontiguousarray(scales)


def host_g_idx(value: Any, k: int, num_groups: int) -> np.ndarray | None:
    """``g_idx`` as int32 ``[K]``, or None when it is the trivial ``k // G``."""
    raw = host_numpy("g_idx", value)
    require_integer_dtype("g_idx", raw)
    g_idx = raw.astype(np.int64)
    if g_idx.shape != (k,):
        raise ValueError(f"argument 'g_idx': expected shape ({k},), got {g_idx.shape}")
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= num_groups):
        raise ValueError(f"argument 'g_idx': groups must lie in [0, {num_groups})")
    if np.array_equal(g_idx, np.arange(k) // (k // num_groups)):
        return None
    return g_idx.astype(np.int32)


def unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """uint32 ``[R, N]`` packed along rows to codes uint8 ``[R * 32 / bits, N]``."""
    per_word = 32 // bits
    shifts = (bits * np.arange(per_word, dtype=np.uint32))[None, :, None]
    codes = (words[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(words.shape[0] * per_word, words.shape[1]).astype(np.uint8)


def unpack_cols(words: np.ndarray, bits: int, order: np.ndarray | None = None) -> np.ndarray:
    """uint32 ``[R, C]`` packed along columns to codes uint8 ``[R, C * 32 / bits]``.

    Slot ``j`` of word ``[r, c]`` holds column ``per_word * c + order[j]``
    (``order`` defaults to ``0, 1, 2, ...``).
    """
    per_word = 32 // bits
    shifts = (bits * np.arange(per_word, dtype=np.uint32))[None, None, :]
    slots = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)  # [R, C, slot]
    if order is not None:
        columns = np.empty_like(slots)
        columns[:, :, order] = slots
        slots = columns
    return slots.reshape(words.shape[0], words.shape[1] * per_word).astype(np.uint8)


def build(
    codes: np.ndarray,
    zeros: np.ndarray,
    scales: np.ndarray,
    g_idx: np.ndarray | None,
    *,
    bits: int,
    symmetric: bool | None,
) -> QuantizedWeight:
    """hal's :class:`QuantizedWeight` from codes ``[K, N]`` and true zero points ``[K/G, N]``."""
    k, n = codes.shape
    default = 1 << (bits - 1)
    is_symmetric = bool((zeros == default).all())
    if symmetric and not is_symmetric:
        raise ValueError(f"symmetric=True, but the zero points are not all {default}")
    if (zeros < 0).any() or (zeros > 255).any():
        raise ValueError("zero points must lie in 0..255 after the checkpoint's offset; check checkpoint_format")
    keep = symmetric is False or not is_symmetric
    qweight = pack_int4(codes) if bits == 4 else codes
    return QuantizedWeight(
        qweight=qweight,
        scales=scales,
        zeros=zeros.astype(np.uint8) if keep else None,
        bits=bits,
        group_size=k // scales.shape[0],
        shape=(k, n),
        g_idx=g_idx,
    )
