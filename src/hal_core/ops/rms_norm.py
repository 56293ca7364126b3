"""``rms_norm``: RMSNorm of each row, with an optional fused residual add (every decoder layer's norm).

``x`` ``[num_tokens, hidden_size]`` (fp32, fp16 or bf16; rows may be strided, the last dimension
contiguous), ``weight`` ``[hidden_size]`` of x's dtype, ``epsilon >= 0``::

    h = x                                   (no residual)
    h = round(x + residual); residual = h   (residual given: the sum, rounded to the dtype, is written
                                             into residual, as a fused add-and-norm does)
    out = h * rsqrt(mean(h ** 2) + epsilon) * (weight_offset + weight)

``weight_offset`` (default 0.0) is 1.0 for norms that store ``weight - 1`` (Gemma). Kernels compute in
float32 (the normalised row is not rounded before the weight multiplies it) and round once into
``out``; the reference is float64. A row holding NaN gives a row of NaN; an infinity gives NaN where it
stands and 0 elsewhere in its row (``inf * rsqrt(inf)``); ``epsilon = 0`` on a row of zeros gives NaN.

In place: ``out`` may be ``x`` itself (a contiguous ``x``: ``out`` is always C-contiguous); ``residual``
must share no element with ``x``, ``weight`` or ``out`` (refused with an ``ArgumentError``: the sum written
into it would be read back as an input). Every check runs before anything is written; implementations
write ``residual`` only once nothing else can fail.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..arrays import dtype_name, numpy_dtype
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import check_disjoint
from ._declare import Arg, BenchCases, Feature, Output
from ._inputs import uniform
from ._spec import OpSpec

__all__ = ["RmsNorm", "norm_dtypes", "rms_norm_inputs"]

#: dtypes rms_norm and gated_activation accept.
norm_dtypes = ("fp32", "fp16", "bf16")
_ROWS = "[num_tokens, hidden_size]"


def norm_form(args: Mapping[str, Any]) -> str:
    """``'fused_add'`` when the call adds a residual first, else ``'plain'``."""
    return "fused_add" if args.get("residual") is not None else "plain"


class RmsNorm(OpSpec):
    """RMSNorm of each row of ``x`` (plus ``residual``, written back) times ``weight_offset + weight``."""

    name = "rms_norm"
    args = (
        Arg.array("x", _ROWS, dtypes=norm_dtypes, contiguous="last"),
        Arg.array("weight", "[hidden_size]", dtype_of="x"),
        Arg.scalar("epsilon", float, minimum=0.0, doc="added to the mean of squares (>= 0)"),
        Arg.out(),
        Arg.array("residual", _ROWS, dtype_of="x", contiguous="last", required=False, mutated=True,
                  doc="added to x first; receives the sum (rounded to the dtype)"),
        Arg.scalar("weight_offset", float, required=False,
                   doc="added to weight (None: 0.0; 1.0 for Gemma-style norms)"),
    )
    output = Output(_ROWS, dtype_of="x")
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["x"])),
        Feature("form", "forms", norm_form, doc="'plain', or 'fused_add' with a residual"),
    )

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        residual = args.get("residual")
        if residual is None:
            return
        check_disjoint("x", args["x"], "residual", residual)
        check_disjoint("weight", args["weight"], "residual", residual)
        if args.get("out") is not None:
            check_disjoint("out", args["out"], "residual", residual)

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``dtype:t<pow2 tokens>``."""
        return f"{dtype_name(args['x'])}:t{pow2(args['x'].shape[0])}"

    def flops(self, args: Mapping[str, Any]) -> int:
        per_element = 4 + (1 if args.get("residual") is not None else 0)  # square-add, scale, weight (+ add)
        return per_element * int(np.prod(args["x"].shape))

    def nbytes(self, args: Mapping[str, Any]) -> int:
        x = args["x"]
        passes = 4 if args.get("residual") is not None else 2  # x, out (+ residual read and written)
        return (passes * int(np.prod(x.shape)) + int(x.shape[1])) * x.dtype.itemsize

    def reference(self, args: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        """``(out, new residual or None)`` in float64; the residual sum is rounded to the dtype first."""
        x = np.asarray(args["x"])
        h = x.astype(np.float64)
        new_residual = None
        if args.get("residual") is not None:
            h = (h + np.asarray(args["residual"]).astype(np.float64)).astype(x.dtype).astype(np.float64)
            new_residual = h.copy()
        weight = np.asarray(args["weight"]).astype(np.float64) + float(args.get("weight_offset") or 0.0)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            scale = 1.0 / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + float(args["epsilon"]))
            return h * scale * weight, new_residual


def rms_norm_inputs(rng: np.random.Generator, *, num_tokens: int, hidden_size: int, dtype: str,
                    residual: bool = True, row_stride: int | None = None) -> dict[str, Any]:
    """Host arguments: rows of scale O(1), a weight around 1, optionally a residual; ``x`` a strided view of
    wider rows when ``row_stride`` > ``hidden_size`` (the columns outside it hold NaN, which must not be read)."""
    np_dtype = numpy_dtype(dtype)
    stride = row_stride or hidden_size
    wide = np.full((num_tokens, stride), np.nan, dtype=np_dtype)
    wide[:, :hidden_size] = rng.standard_normal((num_tokens, hidden_size))
    args: dict[str, Any] = {
        "x": wide[:, :hidden_size],
        "weight": (1.0 + 0.5 * rng.standard_normal(hidden_size)).astype(np_dtype),
        "epsilon": float(10.0 ** rng.uniform(-6, -4)),
    }
    if residual:
        args["residual"] = rng.standard_normal((num_tokens, hidden_size)).astype(np_dtype)
    return args


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {
        "x": uniform(rng, (p["tokens"], p["hidden"]), p["dtype"]),
        "weight": uniform(rng, (p["hidden"],), p["dtype"]),
        "epsilon": 1e-6,
    }
    if p["residual"]:
        args["residual"] = uniform(rng, (p["tokens"], p["hidden"]), p["dtype"])
    return args


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    return rms_norm_inputs(rng, num_tokens=p["tokens"], hidden_size=p["hidden"], dtype=p["dtype"],
                           residual=bool(p["residual"]), row_stride=p["hidden"] + 8)


RmsNorm.bench = BenchCases(
    params={"tokens": 8, "hidden": 4096, "residual": 1, "dtype": "bf16"},
    aliases={"num_tokens": "tokens", "hidden_size": "hidden"},
    may_be_zero=frozenset({"residual"}),
    label=lambda p: (f"rms_norm {p['dtype']} {p['tokens']} tok h{p['hidden']}"
                     f"{' +residual' if p['residual'] else ''}"),
    inputs=_bench_inputs,
    presets={
        "decode": lambda: [{"tokens": t, "hidden": h, "dtype": dt}
                           for t in (1, 8) for h in (2048, 4096) for dt in ("fp32", "bf16")],
        "prefill": lambda: [{"tokens": 512, "hidden": h, "dtype": dt} for h in (2048, 4096) for dt in ("fp32", "bf16")],
        "step": lambda: [{"tokens": t, "hidden": h, "residual": 1, "dtype": dt}
                         for t in (1, 8, 512) for h in (2048, 4096) for dt in ("fp32", "bf16")],
    },
    explain=({"dtype": "bf16", "tokens": 8, "hidden": 4096, "residual": 1},
             {"dtype": "fp32", "tokens": 1, "hidden": 2048, "residual": 0}),
    test_inputs=_test_inputs,
    tiny={"tokens": 1, "hidden": 64, "residual": 1, "dtype": "fp32"},
)

register_op(RmsNorm())
