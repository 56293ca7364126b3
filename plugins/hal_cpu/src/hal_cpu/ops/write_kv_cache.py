"""``write_kv_cache`` on the host: a parallel scatter of contiguous head rows (csrc/dispatch.cpp).

``key``/``value`` may be strided views (a fused QKV projection's slices) as
long as their last dimension is contiguous; slot mappings are int32 or int64;
negative slots are skipped.
"""

from __future__ import annotations

import ctypes

import numpy as np

from hal_core.ops import OpCall

from .. import _abi, _native
from . import _rules
from ._native_args import element_strides, fill_struct, last_contiguous

__all__ = ["scatter", "write_kv_cache"]


def write_kv_cache(call: OpCall) -> None:
    """Scatter ``key``/``value`` rows to their slots in ``key_cache``/``value_cache``."""
    scatter(np.asarray(call["key"]), np.asarray(call["value"]), call["key_cache"], call["value_cache"],
            np.asarray(call["slot_mapping"]))


def scatter(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
            slot_mapping: np.ndarray, *, threads: int | None = None) -> None:
    """The scatter of validated numpy inputs (``threads`` defaults to :func:`~hal_cpu.ops._rules.threads_for`)."""
    native = _native.try_load()
    item = key_cache.itemsize
    direct = (native is not None and key_cache.strides == value_cache.strides
              and key_cache.strides[-1] == item and all(s % item == 0 for s in key_cache.strides))
    if native is None or not direct:
        _numpy_scatter(key, value, key_cache, value_cache, slot_mapping)
        return
    key, value = last_contiguous(key), last_contiguous(value)
    slots = slot_mapping if slot_mapping.flags.c_contiguous else np.ascontiguousarray(slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    if threads is None:
        threads = _rules.threads_for(4 * key.size * item, native.threads)
    kts, khs, _ = element_strides(key)
    vts, vhs, _ = element_strides(value)
    cb, ch, ct, _ = element_strides(key_cache)
    args = fill_struct(_abi.WriteKvCacheArgs, dict(
        key=_native.pointer(key), k_token_stride=kts, k_head_stride=khs,
        value=_native.pointer(value), v_token_stride=vts, v_head_stride=vhs,
        key_cache=_native.pointer(key_cache), value_cache=_native.pointer(value_cache),
        c_block_stride=cb, c_head_stride=ch, c_token_stride=ct, slots=_native.pointer(slots), num_tokens=num_tokens,
        slot_bytes=slots.itemsize, num_kv_heads=num_kv_heads, block_size=key_cache.shape[2], head_size=head_size,
        elem_bytes=item, threads=int(threads)))
    native.lib.hal_cpu_write_kv_cache(ctypes.byref(args))


def _numpy_scatter(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                   slot_mapping: np.ndarray) -> None:
    """The fallback (no compiled kernels, or caches whose rows are not contiguous): one fancy-index scatter each."""
    slots = slot_mapping.astype(np.int64)
    keep = np.flatnonzero(slots >= 0)
    blocks, offsets = np.divmod(slots[keep], key_cache.shape[2])
    new_keys, new_values = key[keep], value[keep]  # gathered first: nothing is written if this fails
    key_cache[blocks, :, offsets] = new_keys
    value_cache[blocks, :, offsets] = new_values
