"""``write_kv_cache``: scatter new keys and values into the paged cache.

``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` go to
``key_cache``/``value_cache`` ``[num_blocks, num_kv_heads, block_size, head_size]``
at ``slot_mapping[i] = block * block_size + offset`` (int32 or int64);
a negative slot skips that token. Slots must be distinct.

``key`` and ``value`` may be strided views whose last dimension is
contiguous (the key and value slices of a fused QKV projection, as engines
pass them); the caches must be C-contiguous, writable and two separate
arrays (no shared memory). Every check runs before anything is written.

Slot values of a host (numpy) ``slot_mapping`` are checked on the host
(range and distinctness, ``HAL_CHECK_INDICES``); a device ``slot_mapping``
is checked by the kernel, which skips a token whose slot is past the cache
and reports ``slot_mapping`` through the device error flag
(:func:`hal_core.check_errors`); two tokens given one device slot leave one
of them there, unspecified which.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._errors import ArgumentTypeError
from ..arrays import dtype_name, numpy_dtype
from ._checks import check_array, check_disjoint, check_slots, check_writable, fail, host_index_checks
from ._spec import OpSpec
from .paged_attention import attention_dtypes

__all__ = ["WriteKVCache"]


class WriteKVCache(OpSpec):
    name = "write_kv_cache"
    array_args = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    inplace_args = ("key_cache", "value_cache")

    def validate(self, args: dict[str, Any], to_numpy: Callable[[Any], np.ndarray]) -> None:
        k, v, kc, vc, slots = (args[n] for n in self.array_args)
        kdt = check_array("key", k, layout="[num_tokens, num_kv_heads, head_size]", ndim=3, dtypes=attention_dtypes,
                          contiguous="last")
        check_array("value", v, layout="[num_tokens, num_kv_heads, head_size]", ndim=3, dtypes=(kdt,),
                    contiguous="last")
        cdt = check_array("key_cache", kc, layout="[num_blocks, num_kv_heads, block_size, head_size]",
                          ndim=4, dtypes=attention_dtypes)
        check_array("value_cache", vc, layout="[num_blocks, num_kv_heads, block_size, head_size]",
                    ndim=4, dtypes=(cdt,))
        if cdt != kdt:
            raise ArgumentTypeError(f"argument 'key': expected dtype {cdt} (the cache's), got {kdt}")
        check_writable("key_cache", kc)
        check_writable("value_cache", vc)
        check_disjoint("key_cache", kc, "value_cache", vc)
        check_array("slot_mapping", slots, layout="[num_tokens]", ndim=1, dtypes=("int32", "int64"))
        if tuple(v.shape) != tuple(k.shape):
            raise fail("value", f"the shape of key {tuple(k.shape)}", f"shape {tuple(v.shape)}")
        if tuple(vc.shape) != tuple(kc.shape):
            raise fail("value_cache", f"the shape of key_cache {tuple(kc.shape)}", f"shape {tuple(vc.shape)}")
        num_tokens, num_kv_heads, head_size = k.shape
        if (kc.shape[1], kc.shape[3]) != (num_kv_heads, head_size):
            raise fail("key_cache", f"num_kv_heads={num_kv_heads} and head_size={head_size} (the key's)",
                       f"shape {tuple(kc.shape)}")
        if slots.shape[0] != num_tokens:
            raise fail("slot_mapping", f"shape ({num_tokens},) (num_tokens)", f"shape {tuple(slots.shape)}")
        if num_tokens and host_index_checks(slots):
            self.check_index_values(args)

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Slots below ``num_blocks * block_size`` (or negative) and distinct (a host ``slot_mapping``)."""
        kc = args["key_cache"]
        check_slots(np.asarray(args["slot_mapping"]), kc.shape[0] * kc.shape[2])

    def output_shape(self, args: Mapping[str, Any]) -> None:
        return None

    def output_dtype(self, args: Mapping[str, Any]) -> np.dtype:
        return numpy_dtype(dtype_name(args["key_cache"]))

    def is_empty(self, args: Mapping[str, Any]) -> bool:
        return 0 in args["key"].shape

    def flops(self, args: Mapping[str, Any]) -> int:
        return 0

    def nbytes(self, args: Mapping[str, Any]) -> int:
        k = args["key"]
        return 4 * int(np.prod(k.shape)) * k.dtype.itemsize

    def reference(self, args: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        kc = np.asarray(args["key_cache"]).astype(np.float64)
        vc = np.asarray(args["value_cache"]).astype(np.float64)
        slots = np.asarray(args["slot_mapping"]).astype(np.int64)
        keep = slots >= 0
        block_size = kc.shape[2]
        blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
        kc[blocks, :, offsets] = np.asarray(args["key"]).astype(np.float64)[keep]
        vc[blocks, :, offsets] = np.asarray(args["value"]).astype(np.float64)[keep]
        return kc, vc
