"""``gated_activation`` on a GPU: ``act(gate) * up`` in one pass (``gated_activation.cu``).

No device read and no synchronisation (CUDA-graph capturable). ``gate`` and ``up`` may be strided views
with contiguous rows (the halves of a fused gate-up projection), read where they are.
"""

from __future__ import annotations

from hal_core.arrays import dtype_name
from hal_core.ops import OpCall
from hal_core.ops.gated_activation import activation_of

from .._arrays import KERNEL_DTYPES, as_storage, empty_like_dtype
from .._cupy import cupy
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device
from ._gated_activation_rules import (
    ACTIVATION_CODES,
    columns_per_cta,
    gated_activation_launch,
    gated_activation_spec,
    specializations,
)
from ._rms_norm import row_stride

__all__ = ["OP", "check", "run"]

_INT32_MAX = 2**31 - 1


def check(call: OpCall) -> str:
    gate = call["gate"]
    num_tokens, inter = gate.shape
    caps = call.capabilities
    if num_tokens > caps.max_grid_dims[0]:
        return f"{num_tokens} tokens exceed the grid's x limit {caps.max_grid_dims[0]}"
    blocks = -(-inter // columns_per_cta(KERNEL_DTYPES[dtype_name(gate)]))
    if inter > _INT32_MAX or blocks > caps.max_grid_dims[1]:
        return f"rows of {inter} elements exceed the kernel's grid or 32-bit sizes"
    return misaligned(call, ("gate", "up"), alignment=gate.dtype.itemsize)


def run(call: OpCall) -> object:
    cp = cupy()
    gate_arg = call["gate"]
    device_index = storage_device(gate_arg)
    hal_dtype = dtype_name(gate_arg)
    gate, up = as_storage(gate_arg), as_storage(call["up"])
    num_tokens, inter = gate.shape
    width = call.backend.device(device_index).capabilities.simd_width
    kdtype = KERNEL_DTYPES[hal_dtype]
    with cp.cuda.Device(device_index):
        out = empty_like_dtype((num_tokens, inter), hal_dtype)
        kernels = kernels_for(call, device_index, gated_activation_spec(kdtype, width))
        launch(call, device_index, kernels, gated_activation_launch(num_tokens, inter, kdtype),
               dict(out=as_storage(out), gate=gate, up=up, gate_stride=row_stride(gate), up_stride=row_stride(up),
                    intermediate_size=inter, activation=ACTIVATION_CODES[activation_of(call.args)]))
    return out


OP = GpuOp("gated_activation", check, run, specializations=specializations)
