"""``gated_activation``: a gated MLP's activation, ``out = act(gate) * up``.

``gate`` and ``up`` ``[num_tokens, intermediate_size]`` (fp32, fp16 or bf16, one dtype; rows may be
strided, the last dimension contiguous, so the two halves of a fused ``[T, 2 * I]`` gate-up projection
are passed as views without a copy); ``activation``:

- ``'silu'`` (None, the default): ``g * sigmoid(g)`` (SwiGLU: Llama, Qwen, Mistral);
- ``'gelu'``: the exact GELU ``0.5 * g * (1 + erf(g / sqrt(2)))`` (GeGLU);
- ``'gelu_tanh'``: the tanh approximation ``0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g ** 3)))``
  (Gemma).

Kernels compute in float32 and round once into ``out``; the reference is float64. NaN in ``gate`` or
``up`` gives NaN in that element; ``act(-inf)`` is NaN (``-inf * 0``) as the formulas above give it in
floating point. ``out`` may be ``gate`` or ``up`` (when that one is contiguous).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..arrays import dtype_name, numpy_dtype
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._declare import Arg, BenchCases, Feature, Output
from ._inputs import uniform
from ._spec import OpSpec
from .rms_norm import norm_dtypes

__all__ = ["ACTIVATIONS", "GatedActivation", "activation_of", "gated_activation_inputs"]

#: The ``activation`` settings, the default first.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_ROWS = "[num_tokens, intermediate_size]"


def activation_of(args: Mapping[str, Any]) -> str:
    """The call's activation (``'silu'`` when None)."""
    return args.get("activation") or "silu"


def _erf(z: np.ndarray) -> np.ndarray:
    """erf in float64 to within 1e-15 (the Taylor series below 2.5, the continued fraction of erfc above)."""
    z = np.asarray(z, dtype=np.float64)
    out = np.empty_like(z)
    a = np.abs(z)
    small = a < 2.5
    s = z[small]
    term, total = s.copy(), s.copy()
    for n in range(1, 60):
        term = term * -(s * s) / n
        total = total + term / (2 * n + 1)
    out[small] = 2.0 / np.sqrt(np.pi) * total
    big = ~small
    b = a[big]
    with np.errstate(invalid="ignore", over="ignore"):
        frac = np.zeros_like(b)
        for k in range(80, 0, -1):  # erfc(x) = exp(-x^2) / sqrt(pi) / (x + (1/2) / (x + 1 / (x + (3/2) / ...)))
            frac = (k / 2.0) / (b + frac)
        erfc = np.exp(-b * b) / np.sqrt(np.pi) / (b + frac)
    erfc = np.where(np.isinf(b), 0.0, erfc)
    out[big] = np.sign(z[big]) * (1.0 - erfc)
    return out


def activate(gate: np.ndarray, activation: str) -> np.ndarray:
    """``act(gate)`` in float64 (the formulas of the module docs)."""
    g = np.asarray(gate).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if activation == "silu":
            return g / (1.0 + np.exp(-g))
        if activation == "gelu":
            return 0.5 * g * (1.0 + _erf(g / np.sqrt(2.0)))
        return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))


class GatedActivation(OpSpec):
    """``act(gate) * up`` for a gated MLP (``activation``: ``'silu'``, ``'gelu'`` or ``'gelu_tanh'``)."""

    name = "gated_activation"
    args = (
        Arg.array("gate", _ROWS, dtypes=norm_dtypes, contiguous="last"),
        Arg.array("up", _ROWS, dtype_of="gate", contiguous="last"),
        Arg.out(),
        Arg.choice("activation", ACTIVATIONS, doc="'silu' (None), 'gelu' (exact erf) or 'gelu_tanh'"),
    )
    output = Output(_ROWS, dtype_of="gate")
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["gate"])),
        Feature("activation", "activations", activation_of),
    )

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``dtype:t<pow2 tokens>``."""
        return f"{dtype_name(args['gate'])}:t{pow2(args['gate'].shape[0])}"

    def flops(self, args: Mapping[str, Any]) -> int:
        return 8 * int(np.prod(args["gate"].shape))  # the activation's few multiply-adds and the gating product

    def nbytes(self, args: Mapping[str, Any]) -> int:
        gate = args["gate"]
        return 3 * int(np.prod(gate.shape)) * gate.dtype.itemsize

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            return activate(args["gate"], activation_of(args)) * np.asarray(args["up"]).astype(np.float64)


def gated_activation_inputs(rng: np.random.Generator, *, num_tokens: int, intermediate_size: int, dtype: str,
                            fused: bool = True, activation: str | None = None) -> dict[str, Any]:
    """Host arguments: ``gate`` and ``up`` as the halves of one fused ``[T, 2 * I]`` projection (``fused``) or
    two arrays; gate values span [-6, 6] so every branch of the activations is used."""
    np_dtype = numpy_dtype(dtype)
    shape = (num_tokens, intermediate_size)
    gate = rng.uniform(-6.0, 6.0, shape)
    up = rng.standard_normal(shape)
    if fused:
        both = np.concatenate([gate, up], axis=1).astype(np_dtype)
        args: dict[str, Any] = {"gate": both[:, :intermediate_size], "up": both[:, intermediate_size:]}
    else:
        args = {"gate": gate.astype(np_dtype), "up": up.astype(np_dtype)}
    if activation is not None:
        args["activation"] = activation
    return args


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    both = uniform(rng, (p["tokens"], 2 * p["inter"]), p["dtype"])
    return {"gate": both[:, :p["inter"]], "up": both[:, p["inter"]:]}


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    return gated_activation_inputs(rng, num_tokens=p["tokens"], intermediate_size=p["inter"], dtype=p["dtype"])


GatedActivation.bench = BenchCases(
    params={"tokens": 8, "inter": 11008, "dtype": "bf16"},
    aliases={"num_tokens": "tokens", "intermediate_size": "inter"},
    label=lambda p: f"gated_activation {p['dtype']} {p['tokens']} tok i{p['inter']}",
    inputs=_bench_inputs,
    presets={
        "decode": lambda: [{"tokens": t, "inter": i, "dtype": dt}
                           for t in (1, 8) for i in (5632, 11008) for dt in ("fp32", "bf16")],
        "prefill": lambda: [{"tokens": 512, "inter": i, "dtype": dt} for i in (5632, 11008) for dt in ("fp32", "bf16")],
        "step": lambda: [{"tokens": t, "inter": i, "dtype": dt}
                         for t in (1, 8, 512) for i in (5632, 11008) for dt in ("fp32", "bf16")],
    },
    explain=({"dtype": "bf16", "tokens": 8, "inter": 11008}, {"dtype": "fp32", "tokens": 1, "inter": 5632}),
    test_inputs=_test_inputs,
    tiny={"tokens": 1, "inter": 64, "dtype": "fp32"},
)

register_op(GatedActivation())
