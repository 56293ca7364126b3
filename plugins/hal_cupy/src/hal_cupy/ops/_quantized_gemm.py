"""``quantized_gemm`` on a GPU: a fused small-M kernel, or dequantise + cuBLAS (``cupy.matmul``) above it.

- ``M <= HAL_<BACKEND>_SMALL_M_MAX`` (default: the catalogue's ``QGEMM_SMALL_M_MAX``):
  ``hal_w4a16_gemm`` / ``hal_w8a8_gemm`` (after ``hal_w8a8_quantize_rows``),
  split over K when N alone does not fill the GPU.
- Larger M: the weight is dequantised to fp16 (fp16 activations) or fp32
  (fp32 and bf16 activations, CuPy having no bf16 matmul) and multiplied by
  cuBLAS with fp32 accumulation. W8A8 multiplies the dequantised int8
  activations ``xq * sx``, so both paths compute the same function.
- K = 0 (an empty sum): the output is filled with zeros, nothing is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hal_core.arrays import dtype_name, is_c_contiguous
from hal_core.ops import OpCall

from .. import _env
from .._arrays import KERNEL_DTYPES, aligned, as_storage, empty_like_dtype
from .._cupy import cupy
from .._specializations import (
    QGEMM_GROUP_SIZES,
    QGEMM_SMALL_M_MAX,
    quant_gemm_launch,
    quant_gemm_m_tile,
    quant_gemm_spec,
    quant_util_launch,
    quant_util_spec,
)
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device

__all__ = ["OP", "check", "run", "small_m_threshold", "uses_small_m"]

_INT32_MAX = 2**31 - 1
#: Alignment the kernels' vector loads need, per QuantizedWeight array.
_WEIGHT_ALIGNMENT = {"qweight": 16, "scales": 8, "zeros": 4}


def small_m_threshold(backend: str) -> int:
    """Largest M for the fused kernel: ``HAL_<BACKEND>_SMALL_M_MAX``, else the catalogue's value."""
    return _env.small_m_max(backend, QGEMM_SMALL_M_MAX)


def uses_small_m(m: int, backend: str) -> bool:
    """Whether ``backend`` runs an M-row GEMM with the fused small-M kernel."""
    return 0 < m <= small_m_threshold(backend)


def check(call: OpCall) -> str:
    x, qw = call["x"], call["qweight"]
    m, k = x.shape
    n = qw.shape[1]
    if qw.g_idx is not None:
        return "act-order weights (g_idx) have no GPU kernel"
    if qw.group_size not in QGEMM_GROUP_SIZES:
        return f"group_size {qw.group_size} has no GPU kernel (built for {QGEMM_GROUP_SIZES})"
    if n % 4:
        return f"N={n} is not a multiple of 4 (the kernels write 4 columns per thread)"
    if dtype_name(qw.scales) != "fp16":
        return (f"scales are {dtype_name(qw.scales)}; the GPU kernels read float16 scales "
                "(quantize(..., scale_dtype=np.float16))")
    if max(m, n, k) > _INT32_MAX or m * n > _INT32_MAX * 4:
        return "dimensions too large for the kernels' 32-bit parameters"
    for name, value in qw.arrays().items():
        if not is_c_contiguous(value):
            return f"argument 'qweight.{name}' is not C-contiguous; pass a contiguous copy"
        if not call.host_arrays and name in _WEIGHT_ALIGNMENT and not aligned(value, _WEIGHT_ALIGNMENT[name]):
            return f"argument 'qweight.{name}' is not {_WEIGHT_ALIGNMENT[name]}-byte aligned"
    return misaligned(call, ("x",))


def _width(call: OpCall, device_index: int) -> int:
    """The device's SIMD width (the kernels are specialised by it)."""
    return call.backend.device(device_index).capabilities.simd_width


def _grid_stride(call: OpCall, device_index: int, kernel: Any, items: int, args: Sequence[Any]) -> None:
    """Launch a quant_util grid-stride kernel (256 threads) with a grid from SM count and occupancy."""
    launcher = call.backend.device(device_index).launcher
    config = launcher.config_for(kernel, items, threads_per_block=256)
    launcher.launch(kernel, config, args)


def _quantize_rows(call: OpCall, device_index: int, x: Any, kdtype: str) -> tuple[Any, Any]:
    cp = cupy()
    m, k = x.shape
    xq = cp.empty((m, k), dtype=np.int8)
    sx = cp.empty((m,), dtype=np.float32)
    util = kernels_for(call, device_index, quant_util_spec(kdtype, _width(call, device_index)))
    plan = quant_util_launch("hal_w8a8_quantize_rows", m, call.backend.device(device_index).capabilities.compute_units)
    launch(call, device_index, util, plan, (xq, sx, x, np.int32(k)))
    return xq, sx


def _small_m(call: OpCall, device_index: int, x: Any, out: Any, kdtype: str,
             weights: tuple[Any, Any, Any]) -> None:
    cp = cupy()
    qw = call["qweight"]
    m, k = x.shape
    n, g = qw.shape[1], qw.group_size
    caps = call.backend.device(device_index).capabilities
    activations = _quantize_rows(call, device_index, x, kdtype) if qw.bits == 8 else (x,)
    gemm = kernels_for(call, device_index, quant_gemm_spec(kdtype, qw.bits, quant_gemm_m_tile(m), caps.simd_width))
    plan, ksplit, per_split = quant_gemm_launch(qw.bits, m, n, k, g, caps.compute_units, caps.simd_width)
    ws = cp.zeros((m, n), dtype=np.float32) if ksplit > 1 else None
    launch(call, device_index, gemm, plan,
           (out, ws, *activations, *weights, np.int32(m), np.int32(n), np.int32(k), np.int32(g),
            np.int32(per_split)))
    if ws is not None:
        util = kernels_for(call, device_index, quant_util_spec(kdtype, _width(call, device_index)))
        _grid_stride(call, device_index, util["hal_f32_to_dtype"], m * n, (out, ws, np.int64(m * n)))


def _large_m(call: OpCall, device_index: int, x: Any, out: Any, hal_dtype: str, kdtype: str,
             weights: tuple[Any, Any, Any]) -> None:
    cp = cupy()
    qw = call["qweight"]
    m, k = x.shape
    n, g = qw.shape[1], qw.group_size
    wdtype = np.float16 if hal_dtype == "fp16" else np.float32
    wname = "float16" if hal_dtype == "fp16" else "float32"
    util_w = kernels_for(call, device_index, quant_util_spec(wname, _width(call, device_index)))
    w = cp.empty((k, n), dtype=wdtype)
    if qw.bits == 4:
        _grid_stride(call, device_index, util_w["hal_w4a16_dequant"], (k // 8) * (n // 4),
                     (w, *weights, np.int32(k), np.int32(n), np.int32(g)))
    else:
        _grid_stride(call, device_index, util_w["hal_w8_dequant"], k * (n // 4),
                     (w, *weights, np.int32(k), np.int32(n), np.int32(g)))
    if qw.bits == 8:
        xq, sx = _quantize_rows(call, device_index, x, kdtype)
        a = (xq.astype(np.float32) * sx[:, None]).astype(wdtype)
    elif hal_dtype == "bf16":
        a = (x.astype(np.uint32) << np.uint32(16)).view(np.float32)  # bf16 bits -> fp32, exact
    else:
        a = x
    if hal_dtype == "bf16":
        y = cp.matmul(a, w)
        util = kernels_for(call, device_index, quant_util_spec("bfloat16", _width(call, device_index)))
        _grid_stride(call, device_index, util["hal_f32_to_dtype"], m * n, (out, y, np.int64(m * n)))
    else:
        cp.matmul(a, w, out=out)


def run(call: OpCall) -> Any:
    cp = cupy()
    x_arg, qw = call["x"], call["qweight"]
    device_index = storage_device(x_arg)
    hal_dtype = dtype_name(x_arg)
    kdtype = KERNEL_DTYPES[hal_dtype]
    x = as_storage(x_arg)
    weights = (as_storage(qw.qweight), as_storage(qw.scales),
               as_storage(qw.zeros) if qw.zeros is not None else None)
    m, k = x.shape
    with cp.cuda.Device(device_index):
        out = call.out if call.out is not None else empty_like_dtype((m, qw.shape[1]), hal_dtype)
        if k == 0:  # an empty sum: zeros, no launch (the kernels' K-split needs at least one group)
            as_storage(out).fill(0)
        elif uses_small_m(m, call.backend.name):
            _small_m(call, device_index, x, as_storage(out), kdtype, weights)
        else:
            _large_m(call, device_index, x, as_storage(out), hal_dtype, kdtype, weights)
    return out


OP = GpuOp("quantized_gemm", check, run)
