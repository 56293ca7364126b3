"""``rms_norm`` on a GPU: one CTA per row (``rms_norm.cu``), the fused residual add in the same kernel.

No device read and no synchronisation (CUDA-graph capturable). ``x`` and ``residual`` may be strided
views with contiguous rows (they are read where they are); ``out`` is a new contiguous array.
"""

from __future__ import annotations

from hal_core.arrays import dtype_name
from hal_core.ops import OpCall

from .._arrays import KERNEL_DTYPES, as_storage, empty_like_dtype
from .._cupy import cupy
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device
from ._rms_norm_rules import rms_norm_launch, rms_norm_spec, specializations

__all__ = ["OP", "check", "run"]

_INT32_MAX = 2**31 - 1


def row_stride(array: object) -> int:
    """The row stride of a 2-D device array in elements."""
    storage = as_storage(array)
    return int(storage.strides[0]) // storage.itemsize


def check(call: OpCall) -> str:
    num_tokens, hidden = call["x"].shape
    caps = call.capabilities
    if num_tokens > caps.max_grid_dims[0]:
        return f"{num_tokens} tokens exceed the grid's x limit {caps.max_grid_dims[0]}"
    if hidden > _INT32_MAX:
        return "rows too long for the kernel's 32-bit hidden_size"
    item = call["x"].dtype.itemsize
    return misaligned(call, ("x", "weight", "residual"), alignment=item)


def run(call: OpCall) -> object:
    cp = cupy()
    x_arg = call["x"]
    device_index = storage_device(x_arg)
    hal_dtype = dtype_name(x_arg)
    x, weight = as_storage(x_arg), as_storage(call["weight"])
    residual = call.args.get("residual")
    residual = None if residual is None else as_storage(residual)
    num_tokens, hidden = x.shape
    width = call.backend.device(device_index).capabilities.simd_width
    with cp.cuda.Device(device_index):
        out = empty_like_dtype((num_tokens, hidden), hal_dtype)
        kernels = kernels_for(call, device_index, rms_norm_spec(KERNEL_DTYPES[hal_dtype], width))
        launch(call, device_index, kernels, rms_norm_launch(num_tokens),
               dict(out=as_storage(out), x=x, weight=weight, residual=residual, x_stride=row_stride(x),
                    residual_stride=0 if residual is None else row_stride(residual), hidden_size=hidden,
                    epsilon=call["epsilon"], weight_offset=call.args.get("weight_offset") or 0.0))
    return out


OP = GpuOp("rms_norm", check, run, specializations=specializations)
