"""``rotary_embedding`` on a GPU: one kernel rotating the query and key heads where they are (strided views too).

No device read and no synchronisation (CUDA-graph capturable): the kernel leaves a token whose position is
outside the table as it is and reports ``positions`` through the device error flag (:mod:`hal_cupy._index_errors`).
"""

from __future__ import annotations

import numpy as np

from hal_core.ops import OpCall

from .._arrays import as_storage, kernel_dtype
from .._cupy import cupy
from .._index_errors import error_flag
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device
from ._rotary_embedding_rules import rotary_embedding_launch, rotary_embedding_spec, specializations

__all__ = ["OP", "check", "run"]

_INT32_MAX = 2**31 - 1


def check(call: OpCall) -> str:
    query, key, table = call["query"], call.args.get("key"), call["cos_sin_cache"]  # table: C-contiguous
    caps = call.capabilities
    if query.shape[0] > caps.max_grid_dims[0]:
        return f"{query.shape[0]} tokens exceed the grid's x limit {caps.max_grid_dims[0]}"
    heads = query.shape[1] + (key.shape[1] if key is not None else 0)
    if heads * table.shape[1] > _INT32_MAX:
        return "heads times rotary_dim too large for the kernel's 32-bit item counter"
    if call.host_arrays:
        return ""  # copied into fresh device arrays
    for name in ("query", "key"):  # strides in whole elements (a view of a wider buffer may have any)
        value = call.args.get(name)
        storage = None if value is None else as_storage(value)
        if storage is not None and any(int(s) % storage.itemsize for s in storage.strides):
            return f"argument {name!r} has strides that are not whole elements; pass a copy"
    return misaligned(call, ("query", "key"), alignment=as_storage(query).itemsize)


def run(call: OpCall) -> None:
    cp = cupy()
    query = as_storage(call["query"])
    device_index = storage_device(query)
    key = call.args.get("key")
    key = as_storage(key) if key is not None else None
    positions, table = as_storage(call["positions"]), as_storage(call["cos_sin_cache"])
    positions = cp.ascontiguousarray(positions)
    item = query.dtype.itemsize
    q_token, q_head = (int(s) // item for s in query.strides[:2])
    k_token, k_head = (int(s) // item for s in key.strides[:2]) if key is not None else (0, 0)
    width = call.backend.device(device_index).capabilities.simd_width
    spec = rotary_embedding_spec(kernel_dtype(call["query"]), pos_int64=positions.dtype == np.int64,
                                 warp_size=width)
    with cp.cuda.Device(device_index):
        kernels = kernels_for(call, device_index, spec)
        launch(call, device_index, kernels, rotary_embedding_launch(query.shape[0]),
               dict(positions=positions, query=query, key=key, cos_sin_cache=table, q_token_stride=q_token,
                    q_head_stride=q_head, k_token_stride=k_token, k_head_stride=k_head, num_heads=query.shape[1],
                    num_kv_heads=key.shape[1] if key is not None else 0, rotary_dim=table.shape[1],
                    gptj=int(call.args.get("style") == "gptj"), max_position=table.shape[0],
                    error_flag=error_flag(device_index)))
    return None


OP = GpuOp("rotary_embedding", check, run, specializations=specializations)
