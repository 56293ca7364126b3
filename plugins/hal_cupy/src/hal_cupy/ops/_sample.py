"""``sample`` on a GPU: one CTA per row (``sample.cu``), logits in their storage dtype, rows may be strided.

No device read and no synchronisation (CUDA-graph capturable): parameter values out of range give that row -1
and are reported through the device error flag (:mod:`hal_cupy._index_errors`).
"""

from __future__ import annotations

import numpy as np

from hal_core.ops import OpCall

from .._arrays import as_storage, kernel_dtype
from .._cupy import cupy
from .._index_errors import error_flag
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device
from ._sample_rules import sample_launch, sample_spec, specializations

__all__ = ["OP", "check", "run"]

_INT32_MAX = 2**31 - 1


def check(call: OpCall) -> str:
    logits = call["logits"]
    num_seqs, vocab = logits.shape
    caps = call.capabilities
    if num_seqs > caps.max_grid_dims[0]:
        return f"{num_seqs} sequences exceed the grid's x limit {caps.max_grid_dims[0]}"
    if vocab > _INT32_MAX:
        return "a vocabulary too large for the kernel's 32-bit indices"
    return misaligned(call, ("logits",), alignment=as_storage(logits).itemsize)


def run(call: OpCall) -> object:
    cp = cupy()
    logits = as_storage(call["logits"])
    device_index = storage_device(logits)
    num_seqs, vocab = logits.shape
    width = call.backend.device(device_index).capabilities.simd_width
    optional = (None if call.args.get(n) is None else as_storage(call[n]) for n in ("top_k", "top_p", "min_p"))
    top_k, top_p, min_p = optional
    with cp.cuda.Device(device_index):
        out = cp.empty((num_seqs,), dtype=np.int64)
        kernels = kernels_for(call, device_index, sample_spec(kernel_dtype(call["logits"]), width))
        launch(call, device_index, kernels, sample_launch(num_seqs),
               dict(logits=logits, row_stride=logits.strides[0] // logits.itemsize, vocab=vocab,
                    temperature=as_storage(call["temperature"]), top_k=top_k, top_p=top_p, min_p=min_p,
                    seeds=as_storage(call["seeds"]), out=out, error_flag=error_flag(device_index)))
    return out


OP = GpuOp("sample", check, run, specializations=specializations)
