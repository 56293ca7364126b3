"""``quantized_gemm``: activations ``x [M, K]`` times a :class:`~hal_core.quant.QuantizedWeight` ``[K, N]``.

- ``bits=4`` (W4A16): ``y = x @ dequantize(w)``, activations kept in float.
- ``bits=8`` (W8A8): activations are quantised per token first
  (:func:`~hal_core.quant.quantize_activations`, in float32), then
  ``y[m, n] = sx[m] * sum_k xq[m, k] * w[k, n]``.

Non-finite activations (docs/quantization.md): in W8A8 a row of ``x``
holding any NaN or infinity gives an all-NaN output row (its scale is NaN);
in W4A16 IEEE arithmetic decides, as in :meth:`QuantizedGemm.reference`.

The output has ``x``'s dtype; accumulation is at least fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from .._errors import ArgumentTypeError
from ..arrays import dtype_name, is_c_contiguous, numpy_dtype
from ..quant import QuantizedWeight, quantize_activations
from ._checks import check_array, fail, host_index_checks
from ._spec import OpSpec

__all__ = ["QuantizedGemm", "gemm_dtypes"]

#: dtypes quantized_gemm accepts for activations.
gemm_dtypes = ("fp16", "bf16", "fp32")


class QuantizedGemm(OpSpec):
    name = "quantized_gemm"
    array_args = ("x", "out")

    def iter_arrays(self, args: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        yield from super().iter_arrays(args)
        qweight = args.get("qweight")
        if isinstance(qweight, QuantizedWeight):
            for name, value in qweight.arrays().items():
                yield f"qweight.{name}", value

    def map_arrays(self, args: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
        mapped = super().map_arrays(args, fn)
        mapped["qweight"] = args["qweight"].map_arrays(fn)
        return mapped

    def validate(self, args: dict[str, Any], to_numpy: Callable[[Any], np.ndarray]) -> None:
        x, qw = args["x"], args["qweight"]
        xdt = check_array("x", x, layout="[M, K]", ndim=2, dtypes=gemm_dtypes)
        if not isinstance(qw, QuantizedWeight):
            raise ArgumentTypeError(
                f"argument 'qweight': expected a hal_core.quant.QuantizedWeight "
                f"(from hal_core.quant.quantize), got {type(qw).__name__}"
            )
        k, n = qw.shape
        if x.shape[1] != k:
            raise fail("x", f"K={k} columns (the weight's in_features)", f"shape {tuple(x.shape)}")
        expected = {"qweight": "uint32" if qw.bits == 4 else "uint8", "zeros": "uint8", "g_idx": "int32"}
        for name, value in qw.arrays().items():
            want = expected.get(name)
            if want and dtype_name(value) != want:
                raise ArgumentTypeError(f"argument 'qweight.{name}': expected dtype {want}, got {dtype_name(value)}")
            if not is_c_contiguous(value):
                raise fail(f"qweight.{name}", "a C-contiguous array", f"strides {getattr(value, 'strides', '?')}")
        if dtype_name(qw.scales) not in ("fp16", "fp32", "bf16"):
            raise ArgumentTypeError(f"argument 'qweight.scales': expected dtype fp16, bf16 or fp32, "
                                    f"got {dtype_name(qw.scales)}")
        out = args.get("out")
        if out is not None:
            check_array("out", out, layout="[M, N]", ndim=2, dtypes=(xdt,))
            if tuple(out.shape) != (x.shape[0], n):
                raise fail("out", f"shape {(x.shape[0], n)}", f"shape {tuple(out.shape)}")
        if qw.g_idx is not None and k and host_index_checks(qw.g_idx):
            self.check_index_values(args)

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Range of the host ``qweight.g_idx`` (a device one is checked once copied to the host, see below).

        No GPU kernel reads ``g_idx``: device act-order weights run on the
        fallback path, which copies them to the host and checks them there.
        """
        qw = args["qweight"]
        k = qw.shape[0]
        if qw.g_idx is None or not k:
            return
        groups = np.asarray(qw.g_idx)
        bad = (groups < 0) | (groups >= k // qw.group_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise fail("qweight.g_idx", f"group indices in [0, {k // qw.group_size})",
                       f"g_idx[{i}] = {int(groups[i])}")

    def output_shape(self, args: Mapping[str, Any]) -> tuple[int, ...]:
        return (args["x"].shape[0], args["qweight"].shape[1])

    def output_dtype(self, args: Mapping[str, Any]) -> np.dtype:
        return numpy_dtype(dtype_name(args["x"]))

    def flops(self, args: Mapping[str, Any]) -> int:
        m = args["x"].shape[0]
        k, n = args["qweight"].shape
        return 2 * m * k * n

    def nbytes(self, args: Mapping[str, Any]) -> int:
        x = args["x"]
        m = x.shape[0]
        n = args["qweight"].shape[1]
        return args["qweight"].nbytes + x.dtype.itemsize * (int(np.prod(x.shape)) + m * n)

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        qw: QuantizedWeight = args["qweight"]
        w = qw.dequantize(np.float64)
        x = np.asarray(args["x"])
        if qw.bits == 8:  # rows holding NaN or inf have a NaN scale: NaN rows (quantize_activations)
            xq, sx = quantize_activations(x)
            return sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ w)
        with np.errstate(invalid="ignore", over="ignore"):  # IEEE arithmetic: inf * 0 is NaN
            return x.astype(np.float64) @ w
