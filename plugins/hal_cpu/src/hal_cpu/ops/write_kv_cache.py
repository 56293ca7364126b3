"""``write_kv_cache`` on the host: a parallel scatter of contiguous head rows (csrc/dispatch.cpp).

``key``/``value`` may be strided views (a fused QKV projection's slices) as
long as their last dimension is contiguous; slot mappings are int32 or int64;
negative slots are skipped.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from hal_core.ops import OpCall, Runner

from .. import _abi, _native
from . import _rules
from ._native_args import element_strides, fill_struct, last_contiguous
from ._planned import struct_runner

__all__ = ["plan_write_kv_cache", "scatter", "write_kv_cache"]


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
    args = fill_struct(_abi.WriteKvCacheArgs, _fields(key, value, key_cache, value_cache, slots, threads,
                                                      native.threads))
    native.lib.hal_cpu_write_kv_cache(ctypes.byref(args))


def plan_write_kv_cache(call: OpCall) -> Runner | None:
    """The runner of ``call``'s signature (:mod:`._planned`), or None where the kernel cannot take its arrays as
    they are."""
    native = _native.try_load()
    key, value, key_cache, value_cache = call["key"], call["value"], call["key_cache"], call["value_cache"]
    slots = call["slot_mapping"]
    item = key_cache.itemsize
    if native is None or key_cache.strides != value_cache.strides or key_cache.strides[-1] != item \
            or any(s % item for s in key_cache.strides) or last_contiguous(key) is not key \
            or last_contiguous(value) is not value or not slots.flags.c_contiguous:
        return None
    fields = _fields(key, value, key_cache, value_cache, slots, None, native.threads)
    return struct_runner(call, write_kv_cache, native.lib.hal_cpu_write_kv_cache, _abi.WriteKvCacheArgs, fields,
                         {"key": "key", "value": "value", "key_cache": "key_cache", "value_cache": "value_cache",
                          "slots": "slot_mapping"})


def _fields(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, slots: np.ndarray,
            threads: int | None, host_threads: int) -> dict[str, Any]:
    """The kernel's argument struct, by field."""
    num_tokens, num_kv_heads, head_size = key.shape
    if threads is None:
        threads = _rules.threads_for(4 * key.size * key_cache.itemsize, host_threads)
    kts, khs, _ = element_strides(key)
    vts, vhs, _ = element_strides(value)
    cb, ch, ct, _ = element_strides(key_cache)
    return dict(key=key, k_token_stride=kts, k_head_stride=khs, value=value, v_token_stride=vts, v_head_stride=vhs,
                key_cache=key_cache, value_cache=value_cache, c_block_stride=cb, c_head_stride=ch, c_token_stride=ct,
                slots=slots, num_tokens=num_tokens, slot_bytes=slots.itemsize, num_kv_heads=num_kv_heads,
                block_size=key_cache.shape[2], head_size=head_size, elem_bytes=key_cache.itemsize,
                threads=int(threads))


def _numpy_scatter(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                   slot_mapping: np.ndarray) -> None:
    """The fallback (no compiled kernels, or caches whose rows are not contiguous): one fancy-index scatter each."""
    slots = slot_mapping.astype(np.int64)
    keep = np.flatnonzero(slots >= 0)
    blocks, offsets = np.divmod(slots[keep], key_cache.shape[2])
    new_keys, new_values = key[keep], value[keep]  # gathered first: nothing is written if this fails
    key_cache[blocks, :, offsets] = new_keys
    value_cache[blocks, :, offsets] = new_values
