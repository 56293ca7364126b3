"""``quantized_gemm`` W4A8 on the host: int4 weights times activations quantised per token to int8.

The activations are quantised bit for bit as :func:`~hal_core.quant.quantize_activations`
(``sx = amax / 127`` per row, ``xq = rint(x / sx)`` half to even, clipped to [-127, 127]);
then ``y = sx * (xq @ dequantize(w))``. A row of ``x`` holding NaN or inf gives a row of NaN.

- Weights without act-order whose group size is a multiple of 8 and at most :data:`W4A8_MAX_GROUP`
  (every GPTQ/AWQ export): the compiled integer kernel (csrc/w4a8.inl): codes times int8
  activations summed exactly in int32 per group (``vpdpbusd`` on AVX512_VNNI, the same integer
  sums in plain code elsewhere), then ``y = fma(scale, float(sum - zero * sum(xq)), y)`` group
  after group, and the token scale last. Every ISA variant and thread count gives the same bits.
- Other weights (act-order ``g_idx``, other group sizes): the integer activations
  (exact in float32) times dequantised tiles with BLAS (:func:`hal_cpu.ops._tiles.tiles`), then
  the token scale; float32 sums, so not bit-identical to the integer kernel.

Allocations per call, besides the float32 result: the integer kernel's ``M * K`` floats (``x`` widened),
``M * K`` bytes (``xq``) and ``M * K / G`` int32 group sums; the tiles path's ``xq`` (int8, then float32)
and the tiles of :func:`~hal_cpu.ops._tiles.tiles`. Never a float copy of the whole weight.
"""

from __future__ import annotations

import numpy as np

from hal_core.quant import QuantizedWeight, quantize_activations

from .. import _abi, _native
from . import _launches, _rules
from ._native_args import dtype_code
from ._tiles import tiles

__all__ = ["W4A8_MAX_GROUP", "gemm", "integer_kernel", "launch"]


#: The largest group the integer kernel takes: ``127 * G * (15 + 255)`` stays below ``2**31`` (csrc/w4a8.inl).
W4A8_MAX_GROUP = 32768


def integer_kernel(qweight: QuantizedWeight) -> bool:
    """Whether the compiled integer kernel serves this int4 weight (else the dequantised tiles do)."""
    return qweight.g_idx is None and qweight.group_size % 8 == 0 and qweight.group_size <= W4A8_MAX_GROUP


def gemm(native: _native.Native, x: np.ndarray, qweight: QuantizedWeight, threads: int | None) -> np.ndarray:
    """W4A8 ``x [M, K]`` (last dimension contiguous) times an int4 ``qweight``, as float32 ``[M, N]``."""
    m, k = x.shape
    n = qweight.shape[1]
    y = np.empty((m, n), dtype=np.float32)
    if integer_kernel(qweight):
        if threads is None:
            signature = ("w4a8", m, x.dtype, x.strides[0], native.threads)
            prepared = _launches.kept(qweight, signature, lambda: launch(native, x, qweight, None))
        else:
            prepared = launch(native, x, qweight, threads)
        if prepared.run(x, y):
            raise MemoryError("quantized_gemm: the CPU kernel could not allocate its activation workspace")
        return y
    if threads is None:
        threads = _rules.threads_for(qweight.nbytes + x.nbytes, native.threads)
    qw, scales, zeros, g_idx, _ = _launches.weight_arrays(qweight)
    xq, sx = quantize_activations(x)  # a row holding NaN or inf: zeros and a NaN scale, so a NaN row below
    xqf = np.ascontiguousarray(xq, dtype=np.float32)
    tiles(native, xqf, k, qweight, qw, scales, zeros, g_idx, y, None, threads)
    y *= sx[:, None]
    return y


def launch(native: _native.Native, x: np.ndarray, qweight: QuantizedWeight, threads: int | None) -> _launches.Launch:
    """The integer kernel's launch for ``x``'s signature (rows, dtype, row stride)."""
    m, k = x.shape
    if threads is None:
        threads = _rules.threads_for(qweight.nbytes + x.nbytes, native.threads)
    qw, scales, zeros, _, derived = _launches.weight_arrays(qweight)  # no g_idx: the integer kernel has none
    return _launches.Launch.build(native.lib.hal_cpu_w4a8_gemm, _abi.W4a8GemmArgs, dict(
        x_stride=x.strides[0] // x.itemsize, m=m, k=k, n=qweight.shape[1], qweight=qw, scales=scales, zeros=zeros,
        group_size=qweight.group_size, x_dtype=dtype_code(x), s_dtype=dtype_code(scales),
        default_zero=qweight.default_zero, threads=int(threads)),
        keep=(qw, scales, zeros), derived=derived)
