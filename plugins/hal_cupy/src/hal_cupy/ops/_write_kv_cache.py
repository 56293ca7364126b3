"""``write_kv_cache`` on a GPU: one byte-copying kernel for every dtype, int32 or int64 slots.

No device read and no synchronisation (CUDA-graph capturable): the kernel skips a slot past the cache and
reports ``slot_mapping`` through the device error flag (:mod:`hal_cupy._index_errors`).
"""

from __future__ import annotations

import numpy as np

from hal_core.arrays import is_c_contiguous
from hal_core.ops import OpCall

from .._arrays import as_storage
from .._cupy import cupy
from .._index_errors import error_flag
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device
from ._write_kv_cache_rules import specializations, write_kv_cache_launch, write_kv_cache_spec

__all__ = ["OP", "check", "run"]

_INT32_MAX = 2**31 - 1


def check(call: OpCall) -> str:
    key, cache = call["key"], call["key_cache"]
    if not (is_c_contiguous(cache) and is_c_contiguous(call["value_cache"])):
        return "the kernel writes C-contiguous caches (strided cache views run on the CPU path)"
    num_tokens, _, head_size = key.shape
    caps = call.capabilities
    if num_tokens > caps.max_grid_dims[0]:
        return f"{num_tokens} tokens exceed the grid's x limit {caps.max_grid_dims[0]}"
    if head_size * key.dtype.itemsize > _INT32_MAX or max(cache.shape) > _INT32_MAX:
        return "rows or cache dimensions too large for the kernel's 32-bit parameters"
    # the kernel copies units of at least 2 bytes (every dtype is); an odd address is no element boundary
    return misaligned(call, ("key", "value", "key_cache", "value_cache"), alignment=2)


def run(call: OpCall) -> None:
    cp = cupy()
    device_index = storage_device(call["key_cache"])
    key, value, key_cache, value_cache, slots = (
        as_storage(call[n]) for n in ("key", "value", "key_cache", "value_cache", "slot_mapping"))
    # the kernel reads dense [num_tokens, num_kv_heads, head_size] rows; strided views (a fused QKV's slices) are
    # packed first (one copy of the new tokens only)
    key, value = cp.ascontiguousarray(key), cp.ascontiguousarray(value)
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = key_cache.shape[2]
    width = call.backend.device(device_index).capabilities.simd_width
    spec = write_kv_cache_spec(slot_int64=slots.dtype == np.int64, warp_size=width)
    with cp.cuda.Device(device_index):
        kernels = kernels_for(call, device_index, spec)
        launch(call, device_index, kernels, write_kv_cache_launch(num_tokens),
               dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots,
                    num_kv_heads=num_kv_heads, block_size=block_size, row_bytes=head_size * key.dtype.itemsize,
                    num_blocks=key_cache.shape[0], error_flag=error_flag(device_index)))
    return None


OP = GpuOp("write_kv_cache", check, run, specializations=specializations)
