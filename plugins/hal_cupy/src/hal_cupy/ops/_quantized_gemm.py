"""``quantized_gemm`` on a GPU: tensor-core kernels, SIMT kernels, or K-slabs on cuBLAS.

Selection, per call:

- Tensor cores (the platform's warp matrix instructions at level
  ``QGEMM_TC_MIN_SM``, see :meth:`hal_cupy.GpuPlatform.warp_mma_level`;
  ``HAL_<BACKEND>_TENSOR_CORES`` not 0): ``quant_gemm_tc.cu`` on the weight's
  tensor-core layout (packed once per ``QuantizedWeight`` and cached, see
  :mod:`hal_cupy._tc_pack`). W4A16 (fp16/bf16) up to ``QGEMM_TC_M_MAX`` rows;
  the int8 MMA at every M and dtype for W8A8 (after ``hal_w8a8_quantize_rows``)
  and W4A8 (int4 weights with ``activations='int8'``, after
  ``hal_w4a8_quantize_rows``). A K split writes fp32 partials that
  ``hal_tc_reduce`` sums in split order (no atomics).
- W4A8 runs only there: without those instructions :func:`check` refuses it
  (the call falls back to the host), and the backend declares ``'w4a8'`` only
  when every device has them (:func:`w4a8_everywhere`).
- Otherwise, ``M <= HAL_<BACKEND>_SMALL_M_MAX`` (default ``QGEMM_SMALL_M_MAX``):
  the SIMT kernels ``hal_w4a16_gemm`` / ``hal_w8a8_gemm``, split over K when N
  alone does not fill the GPU; the splits' fp32 partials are summed in split
  order by ``hal_f32_splits_to_dtype`` (no atomics).
- Larger M: K-slabs of at most ``QGEMM_SLAB_BYTES`` of the weight are
  dequantised in turn into one small workspace, in the activations' dtype (bf16
  stays bf16 where the device lists bf16), and accumulated by cuBLAS ``gemmEx``
  (fp32 accumulation, ``beta = 1`` from the second slab on) -- never a
  whole-weight copy. W8A8 multiplies the dequantised int8 activations ``xq * sx``.
- K = 0 (an empty sum): the output is filled with zeros, nothing is launched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hal_core.arrays import dtype_name, is_c_contiguous
from hal_core.ops import OpCall
from hal_core.ops.quantized_gemm import int8_activations

from .. import _env
from .._arrays import KERNEL_DTYPES, aligned, as_storage, empty_like_dtype
from .._cupy import cupy
from .._kernel_params import pack
from .._tc_pack import PackedWeight, PackedWeightCache, pack_weight
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device, tensor_cores_available
from ._quantized_gemm_rules import (
    QGEMM_GROUP_SIZES,
    QGEMM_SMALL_M_MAX,
    QGEMM_TC_M_MAX,
    QGEMM_TC_MIN_SM,
    quant_gemm_launch,
    quant_gemm_m_tile,
    quant_gemm_spec,
    quant_gemm_tc_launch,
    quant_gemm_tc_m_frags,
    quant_gemm_tc_reduce_launch,
    quant_gemm_tc_spec,
    quant_util_launch,
    quant_util_spec,
    specializations,
)

__all__ = ["OP", "PACKED", "check", "run", "small_m_threshold", "uses_small_m", "uses_tensor_cores",
           "w4a8_everywhere"]

#: Tensor-core layouts of the weights seen, per (weight, device), one cache per backend name;
#: each bounded by ``HAL_<BACKEND>_PACKED_CACHE_MB`` when first used.
PACKED: dict[str, PackedWeightCache] = {}
#: Bytes of dequantised weight per K-slab on the large-M path.
QGEMM_SLAB_BYTES = 32 << 20
#: cudaDataType codes and cuBLAS constants used by the large-M path.
_CUDA_R = {"fp32": 0, "fp16": 2, "bf16": 14}
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1

_INT32_MAX = 2**31 - 1
#: Alignment the kernels' vector loads need, per QuantizedWeight array.
_WEIGHT_ALIGNMENT = {"qweight": 16, "scales": 8, "zeros": 4}


def small_m_threshold(backend: str) -> int:
    """Largest M for the fused kernel: ``HAL_<BACKEND>_SMALL_M_MAX``, else ``QGEMM_SMALL_M_MAX``."""
    return _env.small_m_max(backend, QGEMM_SMALL_M_MAX)


def uses_small_m(m: int, backend: str) -> bool:
    """Whether ``backend`` runs an M-row GEMM with the fused small-M kernel."""
    return 0 < m <= small_m_threshold(backend)


def uses_tensor_cores(backend: Any, device_index: int, hal_dtype: str, bits: int, m: int,
                      int8_act: bool = False) -> bool:
    """True when ``quant_gemm_tc.cu`` serves this call (see the module docs); ``int8_act``: W4A8 (int4 weights,
    int8 activations; int8 weights always have them)."""
    if m <= 0 or not tensor_cores_available(backend, device_index, QGEMM_TC_MIN_SM):
        return False
    if bits == 8 or int8_act:  # the int8 MMA: every dtype, every M
        return True
    return hal_dtype in ("fp16", "bf16") and m <= QGEMM_TC_M_MAX


def w4a8_everywhere(backend: Any) -> bool:
    """Whether every device of ``backend`` runs W4A8 on its int8 MMA (the ``'w4a8'`` coverage declaration): at
    least one device, each with warp matrix instructions of level ``QGEMM_TC_MIN_SM``, tensor cores not switched
    off."""
    count = len(backend.devices())
    return count > 0 and all(tensor_cores_available(backend, i, QGEMM_TC_MIN_SM) for i in range(count))


def _device_index(call: OpCall) -> int:
    """The device a call runs on: its activations', or (host inputs, copied in) the current one."""
    return int(cupy().cuda.runtime.getDevice()) if call.host_arrays else storage_device(call["x"])


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
    if qw.bits == 4 and int8_activations(call.args) and k and not tensor_cores_available(
            call.backend, _device_index(call), QGEMM_TC_MIN_SM):
        return (f"W4A8 (activations='int8') runs on the int8 tensor-core MMA only (warp matrix instructions of "
                f"level {QGEMM_TC_MIN_SM}); this device has none or they are switched off")
    for name, value in qw.arrays().items():
        if not is_c_contiguous(value):
            return f"argument 'qweight.{name}' is not C-contiguous; pass a contiguous copy"
        if not call.host_arrays and name in _WEIGHT_ALIGNMENT and not aligned(value, _WEIGHT_ALIGNMENT[name]):
            return f"argument 'qweight.{name}' is not {_WEIGHT_ALIGNMENT[name]}-byte aligned"
    return misaligned(call, ("x",))


def _width(call: OpCall, device_index: int) -> int:
    """The device's SIMD width (the kernels are specialised by it)."""
    return call.backend.device(device_index).capabilities.simd_width


def _grid_stride(call: OpCall, device_index: int, kernel: Any, items: int, args: Mapping[str, Any]) -> None:
    """Launch a quant_util grid-stride kernel (256 threads, arguments by parameter name) with a grid from SM count
    and occupancy."""
    launcher = call.backend.device(device_index).launcher
    config = launcher.config_for(kernel, items, threads_per_block=256)
    launcher.launch(kernel, config, pack(kernel.name, args))


def _quantize_rows(call: OpCall, device_index: int, x: Any, kdtype: str,
                   kernel: str = "hal_w8a8_quantize_rows") -> tuple[Any, Any]:
    """``x``'s rows quantised per token on the device (``kernel``: in column order, or ``hal_w4a8_quantize_rows``
    in the W4A8 GEMM's k order): ``xq`` int8 ``[M, K]`` and ``sx`` float32 ``[M]``."""
    cp = cupy()
    m, k = x.shape
    xq = cp.empty((m, k), dtype=np.int8)
    sx = cp.empty((m,), dtype=np.float32)
    util = kernels_for(call, device_index, quant_util_spec(kdtype, _width(call, device_index)))
    plan = quant_util_launch(kernel, m, call.backend.device(device_index).capabilities.compute_units)
    launch(call, device_index, util, plan, dict(xq=xq, sx=sx, x=x, K=k))
    return xq, sx


def _activations(call: OpCall, device_index: int, x: Any, kdtype: str) -> dict[str, Any]:
    """The GEMM kernels' activation arguments: ``x``, or (W8A8, W4A8) its rows quantised, ``xq`` and ``sx``."""
    if not int8_activations(call.args):
        return {"x": x}
    kernel = "hal_w8a8_quantize_rows" if call["qweight"].bits == 8 else "hal_w4a8_quantize_rows"
    xq, sx = _quantize_rows(call, device_index, x, kdtype, kernel)
    return {"xq": xq, "sx": sx}


def _small_m(call: OpCall, device_index: int, x: Any, out: Any, kdtype: str,
             weights: tuple[Any, Any, Any]) -> None:
    cp = cupy()
    qw = call["qweight"]
    m, k = x.shape
    n, g = qw.shape[1], qw.group_size
    caps = call.backend.device(device_index).capabilities
    activations = _activations(call, device_index, x, kdtype)
    gemm = kernels_for(call, device_index, quant_gemm_spec(kdtype, qw.bits, quant_gemm_m_tile(m), caps.simd_width))
    plan, ksplit, per_split = quant_gemm_launch(qw.bits, m, n, k, g, caps.compute_units, caps.simd_width)
    ws = cp.empty((ksplit, m, n), dtype=np.float32) if ksplit > 1 else None  # every element is written
    launch(call, device_index, gemm, plan,
           dict(out=out, ws=ws, **activations, qweight=weights[0], scales=weights[1], zeros=weights[2], M=m, N=n,
                K=k, group_size=g, groups_per_split=per_split))
    if ws is not None:  # the splits' partials, added in split order: deterministic
        util = kernels_for(call, device_index, quant_util_spec(kdtype, _width(call, device_index)))
        _grid_stride(call, device_index, util["hal_f32_splits_to_dtype"], m * n,
                     dict(out=out, ws=ws, count=m * n, splits=ksplit))


def _packed(call: OpCall, device_index: int) -> PackedWeight:
    """The call's weight in the tensor-core layout: from the cache, else packed on the device (integer ops only)."""
    qw = call["qweight"]
    cache = PACKED.get(call.backend.name)
    if cache is None:
        cache = PACKED.setdefault(call.backend.name, PackedWeightCache(_env.packed_cache_bytes(call.backend.name)))
    return cache.get(qw, device_index, lambda: pack_weight(qw.map_arrays(as_storage), cupy()))


def _tensor_core(call: OpCall, device_index: int, x: Any, out: Any, kdtype: str) -> None:
    cp = cupy()
    qw = call["qweight"]
    m, k = x.shape
    n, g = qw.shape[1], qw.group_size
    caps = call.backend.device(device_index).capabilities
    packed = _packed(call, device_index)
    int8_act = int8_activations(call.args)
    activations = _activations(call, device_index, x, kdtype)
    kernels = kernels_for(call, device_index,
                          quant_gemm_tc_spec(kdtype, qw.bits, quant_gemm_tc_m_frags(m), int8_activations=int8_act))
    plan, ksplit, per_split = quant_gemm_tc_launch(qw.bits, m, n, k, g, caps.compute_units,
                                                   int8_activations=int8_act)
    ws = cp.empty((ksplit, m, n), dtype=np.float32) if ksplit > 1 else None  # every element is written
    launch(call, device_index, kernels, plan,
           dict(out=out, ws=ws, **activations, qtc=packed.qtc, scales=packed.scales, zeros=packed.zeros, M=m, N=n,
                K=k, group_size=g, kb_per_split=per_split))
    if ws is not None:
        launch(call, device_index, kernels, quant_gemm_tc_reduce_launch(m, n, caps.compute_units),
               dict(out=out, ws=ws, count=m * n, splits=ksplit))


def slab_rows(k: int, n: int, group_size: int, elem_bytes: int, budget: int = QGEMM_SLAB_BYTES) -> int:
    """Rows of K per dequantised slab: a multiple of the group size (and of 8), at most ``budget`` bytes, >= 1 group."""
    unit = group_size * 8 // math.gcd(group_size, 8)
    rows = max(unit, budget // (n * elem_bytes) // unit * unit)
    return int(min(rows, k))


def _gemm_accumulate(a_ptr: int, lda: int, w: Any, c: Any, m: int, n: int, k: int, ab_type: int, c_type: int,
                     beta: float) -> None:
    """``c[m, n] = a[m, k] @ w[k, n] + beta * c`` (row-major; ``a`` at ``a_ptr`` with row stride ``lda``) on cuBLAS."""
    cp = cupy()
    alpha_host = np.ones(1, np.float32)
    beta_host = np.full(1, beta, np.float32)
    # Row-major C = A @ W is column-major C^T = W^T @ A^T: cuBLAS m = N, n = M.
    cp.cuda.cublas.gemmEx(cp.cuda.device.get_cublas_handle(), 0, 0, n, m, k, alpha_host.ctypes.data, w.data.ptr,
                          ab_type, n, a_ptr, ab_type, lda, beta_host.ctypes.data, c.data.ptr, c_type, n,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)


def _large_m(call: OpCall, device_index: int, x: Any, out: Any, hal_dtype: str, kdtype: str,
             weights: tuple[Any, Any, Any]) -> None:
    cp = cupy()
    qw = call["qweight"]
    m, k = x.shape
    n, g = qw.shape[1], qw.group_size
    caps = call.backend.device(device_index).capabilities
    # GEMM input dtype: the activations' own (bf16 where the device computes in bf16), else fp32.
    gdtype = hal_dtype if hal_dtype != "bf16" or "bf16" in caps.dtypes else "fp32"
    gkernel = KERNEL_DTYPES[gdtype]
    elem = 4 if gdtype == "fp32" else 2
    util_g = kernels_for(call, device_index, quant_util_spec(gkernel, caps.simd_width))
    if qw.bits == 8:  # the dequantised int8 activations xq * sx, in the GEMM dtype
        xq, sx = _quantize_rows(call, device_index, x, kdtype)
        deq = xq.astype(np.float32) * sx[:, None]
        if gdtype == "fp32":
            a = deq
        else:
            a = cp.empty((m, k), dtype=np.uint16 if gdtype == "bf16" else np.float16)
            _grid_stride(call, device_index, util_g["hal_f32_to_dtype"], m * k, dict(out=a, ws=deq, count=m * k))
    elif gdtype == "fp32" and hal_dtype == "bf16":
        a = (x.astype(np.uint32) << np.uint32(16)).view(np.float32)  # bf16 bits -> fp32, exact
    else:
        a = x
    rows = slab_rows(k, n, g, elem, QGEMM_SLAB_BYTES)
    slabs = -(-k // rows)
    direct = slabs == 1 or hal_dtype == "fp32"  # accumulate in out itself only when it is fp32 or nothing adds up
    c = out if direct else cp.empty((m, n), dtype=np.float32)
    c_type = _CUDA_R[hal_dtype] if direct else _CUDA_R["fp32"]
    w = cp.empty((rows, n), dtype=np.float32 if gdtype == "fp32" else np.uint16 if gdtype == "bf16" else np.float16)
    qweight, scales, zeros = weights
    dequant = util_g["hal_w4a16_dequant" if qw.bits == 4 else "hal_w8_dequant"]
    for i in range(slabs):
        k0 = i * rows
        kr = min(rows, k - k0)
        q_slab = qweight[k0 // 8: (k0 + kr) // 8] if qw.bits == 4 else qweight[k0: k0 + kr]
        g0, g1 = k0 // g, (k0 + kr) // g
        z_slab = zeros[g0:g1] if zeros is not None else None
        items = (kr // 8) * (n // 4) if qw.bits == 4 else kr * (n // 4)
        _grid_stride(call, device_index, dequant, items,
                     dict(w=w, qweight=q_slab, scales=scales[g0:g1], zeros=z_slab, K=kr, N=n, group_size=g))
        _gemm_accumulate(a.data.ptr + k0 * a.dtype.itemsize, k, w, c, m, n, kr, _CUDA_R[gdtype], c_type,
                         0.0 if i == 0 else 1.0)
    if c is not out:
        util = kernels_for(call, device_index, quant_util_spec(kdtype, caps.simd_width))
        _grid_stride(call, device_index, util["hal_f32_to_dtype"], m * n, dict(out=out, ws=c, count=m * n))


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
        out = empty_like_dtype((m, qw.shape[1]), hal_dtype)
        if k == 0:  # an empty sum: zeros, no launch (the kernels' K-split needs at least one group)
            as_storage(out).fill(0)
        elif uses_tensor_cores(call.backend, device_index, hal_dtype, qw.bits, m, int8_activations(call.args)):
            _tensor_core(call, device_index, x, as_storage(out), kdtype)
        elif uses_small_m(m, call.backend.name):
            _small_m(call, device_index, x, as_storage(out), kdtype, weights)
        else:
            _large_m(call, device_index, x, as_storage(out), hal_dtype, kdtype, weights)
    return out


OP = GpuOp("quantized_gemm", check, run, specializations=specializations)
