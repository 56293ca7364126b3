"""``fused_moe``: a mixture-of-experts layer, each token through its top-k experts' gated MLPs.

Arguments: ``hidden_states [num_tokens, hidden]`` (fp32, fp16 or bf16), ``router_logits
[num_tokens, num_experts]`` (fp32 or the hidden dtype), ``experts`` (:class:`~hal_core.quant.ExpertWeights`
from :func:`~hal_core.quant.quantize_experts`: per expert ``e`` an int4 or int8 ``w13[e]`` ``[hidden,
2 * intermediate]``, gate columns then up columns, and ``w2[e]`` ``[intermediate, hidden]``), ``top_k``
(1 <= top_k <= num_experts). Result ``[num_tokens, hidden]`` in the hidden dtype::

    ids, w = route(router_logits[t])                       # top_k expert ids and their weights
    out[t] = sum_j w[j] * (act(x[t] @ gate[ids[j]]) * (x[t] @ up[ids[j]])) @ w2[ids[j]]

Routing (``routing``; the selected experts are the ``top_k`` largest logits, which are the ``top_k``
largest softmax probabilities since softmax is monotone; ties go to the lowest expert index):

- ``'softmax_topk'`` (None, the default): the weights are the selected experts' probabilities of the
  softmax over all experts, not renormalised (Qwen2-MoE, Qwen3-MoE with ``norm_topk_prob=False``);
- ``'softmax_topk_renorm'``: the same probabilities renormalised to sum 1 (Mixtral, Qwen3-MoE with
  ``norm_topk_prob=True``);
- ``'topk_softmax'``: the softmax over the selected experts' logits (the same values as
  ``'softmax_topk_renorm'`` in exact arithmetic, computed without the full softmax).

``activation``: as :mod:`~hal_core.ops.gated_activation` (``'silu'``, the default; ``'gelu'``,
``'gelu_tanh'``). Each expert's two projections are ``quantized_gemm`` s of its weights, with
``activations`` as ``quantized_gemm``'s: int4 experts keep the activations in float (W4A16, ``'float'``
or None) or quantise each GEMM's input rows per token (W4A8, ``'int8'``,
:func:`~hal_core.quant.quantize_activations`), the gated intermediate included; int8 experts always do
(W8A8). ``'auto'`` lets the backend choose per call (:meth:`FusedMoe.auto_rule`: int8 from
:data:`~hal_core.ops.quantized_gemm.INT8_ACTIVATIONS_FROM_M` tokens where the backend declares W4A8 for
this op and the device has int8 dot products). W4A8 reaches only a backend that declares the ``'w4a8'``
scheme for ``fused_moe`` (elsewhere the call falls back). Implementations keep the intermediate in at
least float32, accumulate the weighted sum in at least float32 and round once into the output.

A NaN router logit makes its token's softmax (and so its output row) NaN in the ``softmax_topk``
modes. ``nbytes`` counts the experts a call reads as the expected number of distinct experts hit by
``num_tokens * top_k`` uniform draws, ``E * (1 - (1 - top_k / E) ** num_tokens)`` (exactly ``top_k`` at
one token, all ``E`` at a prompt), times one expert's bytes, plus the activations and logits. There is
no ``torch.ops.hal.fused_moe`` operator: a torch schema holds at most one :class:`QuantizedWeight`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from .._errors import ArgumentError, ArgumentTypeError
from ..arrays import dtype_name, numpy_dtype
from ..quant import ExpertWeights, QuantizedWeight, quantize_activations, quantize_experts
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import fail
from ._declare import Arg, BenchCases, Feature, Output
from ._inputs import uniform
from ._per_value import PerValue
from ._spec import OpSpec
from .gated_activation import ACTIVATIONS, activate, activation_of
from .quantized_gemm import ACTIVATIONS as PRECISIONS
from .quantized_gemm import activation_candidates, activation_rule, check_weight_layout, gemm_dtypes, random_weight

__all__ = ["ROUTINGS", "FusedMoe", "expected_experts", "fused_moe_inputs", "int8_activations", "moe_scheme",
           "reference_routing", "routing_of"]

#: The ``routing`` settings, the default first.
ROUTINGS = ("softmax_topk", "softmax_topk_renorm", "topk_softmax")
#: The ``ExpertWeights`` values whose arrays passed :meth:`FusedMoe.check_layout` (weakly: they go with the value).
_LAYOUT_CHECKED: PerValue[bool] = PerValue()


def routing_of(args: Mapping[str, Any]) -> str:
    """The call's routing (``'softmax_topk'`` when None)."""
    return args.get("routing") or "softmax_topk"


def _check_experts_layout(experts: ExpertWeights) -> bool:
    """ArgumentError / ArgumentTypeError naming the first expert array of a wrong dtype or layout; True when none."""
    for name, weight in experts.weights().items():
        check_weight_layout(weight, f"experts.{name}")
    return True


def expected_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """The expected number of distinct experts ``num_tokens`` tokens routed uniformly to ``top_k`` each reach."""
    if num_tokens == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def reference_routing(logits: np.ndarray, top_k: int, routing: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [T, top_k] int64, weights [T, top_k] float64)``: each token's experts by descending logit (ties:
    lowest index first) and their weights, in float64, one token at a time."""
    logits = np.asarray(logits).astype(np.float64)
    tokens, experts = logits.shape
    ids = np.zeros((tokens, top_k), dtype=np.int64)
    weights = np.zeros((tokens, top_k), dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        for t in range(tokens):
            row = logits[t]
            order = sorted(range(experts), key=lambda e: (-row[e] if not np.isnan(row[e]) else np.inf, e))
            chosen = np.array(order[:top_k], dtype=np.int64)
            ids[t] = chosen
            if routing == "topk_softmax":
                picked = np.exp(row[chosen] - row[chosen].max())
                weights[t] = picked / picked.sum()
                continue
            full = np.exp(row - row.max())
            probs = full[chosen] / full.sum()
            weights[t] = probs / probs.sum() if routing == "softmax_topk_renorm" else probs
    return ids, weights


def int8_activations(args: Mapping[str, Any]) -> bool:
    """Whether a validated call's expert GEMMs quantise their input rows to int8 (int8 experts, or
    ``activations='int8'``; ``'auto'`` counts as float until :meth:`FusedMoe.settle` replaces it)."""
    return int(args["experts"].bits) == 8 or args.get("activations") == "int8"


def moe_scheme(args: Mapping[str, Any]) -> str:
    """The experts' arithmetic: ``'w4a16'``, ``'w4a8'`` or ``'w8a8'`` (the ``scheme`` coverage feature)."""
    return f"w{int(args['experts'].bits)}a{8 if int8_activations(args) else 16}"


def _project(x: np.ndarray, weight: QuantizedWeight, int8: bool) -> np.ndarray:
    """``x @ weight`` in float64 (``int8``: x quantised per token first, as ``quantized_gemm``)."""
    w = weight.dequantize(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if int8:
            xq, sx = quantize_activations(x.astype(np.float32))
            return sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ w)
        return x @ w


class FusedMoe(OpSpec):
    """A mixture-of-experts layer: route each token to its top-k experts, run their quantized gated MLPs, sum."""

    name = "fused_moe"
    args = (
        Arg.array("hidden_states", "[num_tokens, hidden]", dtypes=gemm_dtypes),
        Arg.array("router_logits", "[num_tokens, num_experts]", dtypes=gemm_dtypes,
                  doc="fp32 or hidden_states' dtype"),
        Arg.weight("experts", "[num_experts, hidden, intermediate_size]", kind=ExpertWeights,
                   doc="from hal_core.quant.quantize_experts: per expert w13 [hidden, 2 * intermediate] "
                       "(gate | up) and w2 [intermediate, hidden], int4 or int8"),
        Arg.scalar("top_k", int, minimum=1, doc="experts per token, at most num_experts"),
        Arg.out(),
        Arg.choice("routing", ROUTINGS, doc="'softmax_topk' (None), 'softmax_topk_renorm' or 'topk_softmax'"),
        Arg.choice("activation", ACTIVATIONS, doc="'silu' (None), 'gelu' (exact erf) or 'gelu_tanh'"),
        Arg.choice("activations", PRECISIONS,
                   doc="int4 experts: 'float' (W4A16, None), 'int8' (W4A8: each GEMM's rows quantised per token) "
                       "or 'auto'; int8 experts always run W8A8"),
    )
    auto_settings: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({"activations": ("float", "int8")})
    output = Output("[num_tokens, hidden]", dtype_of="hidden_states")
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["hidden_states"])),
        Feature("bits", "bits", lambda args: int(args["experts"].bits)),
        Feature("group_size", "group_sizes", lambda args: int(args["experts"].group_size)),
        Feature("activation", "activations", activation_of),
        Feature("scheme", "schemes", moe_scheme, opt_in=("w4a8",),
                doc="'w4a16', 'w4a8' or 'w8a8'; W4A8 runs only on a backend that declares it (else it falls back)"),
    )

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        logits_dtype = dtype_name(args["router_logits"])
        hidden_dtype = dtype_name(args["hidden_states"])
        if logits_dtype not in ("fp32", hidden_dtype):
            raise ArgumentTypeError(f"argument 'router_logits': expected dtype fp32 or {hidden_dtype} "
                                    f"(hidden_states'), got {logits_dtype}")
        if args["top_k"] > sizes["num_experts"]:
            raise fail("top_k", f"an int in [1, {sizes['num_experts']}] (num_experts)", args["top_k"])

    def check_layout(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        """Every expert's arrays: dtypes and C order, once per ``ExpertWeights`` value (O(experts) Python; the value
        and its weights are frozen, so their arrays stay the ones checked)."""
        _LAYOUT_CHECKED.get(args["experts"], _check_experts_layout)

    def auto_candidates(self, name: str, args: Mapping[str, Any], coverage: Any) -> tuple[tuple[str, ...], str]:
        """``activations="auto"``: int8 experts always run W8A8; int4 ones choose where the backend declares W4A8."""
        return activation_candidates(int(args["experts"].bits), coverage, "experts") or (self.auto_settings[name], "")

    def auto_rule(self, name: str, args: Mapping[str, Any], features: frozenset[str]) -> tuple[str, str]:
        """``quantized_gemm``'s rule on the call's tokens: int8 activations from
        :data:`~hal_core.ops.quantized_gemm.INT8_ACTIVATIONS_FROM_M` tokens up where the device has int8 dot
        products (feature ``int8_dot``), float below and on every other device."""
        return activation_rule(int(args["hidden_states"].shape[0]), features, "tokens")

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``w<bits>:t<pow2 tokens>`` (``w4a8:t<pow2 tokens>`` with int4 experts and int8 activations)."""
        bits = int(args["experts"].bits)
        kind = "w4a8" if bits == 4 and args.get("activations") == "int8" else f"w{bits}"
        return f"{kind}:t{pow2(args['hidden_states'].shape[0])}"

    def flops(self, args: Mapping[str, Any]) -> int:
        tokens, hidden = args["hidden_states"].shape
        inter = args["experts"].shape[2]
        return int(tokens) * int(args["top_k"]) * 6 * int(hidden) * int(inter)

    def nbytes(self, args: Mapping[str, Any]) -> int:
        x, logits, experts = args["hidden_states"], args["router_logits"], args["experts"]
        tokens = x.shape[0]
        routed = round(expected_experts(tokens, experts.num_experts, int(args["top_k"])))
        activations = 2 * int(np.prod(x.shape)) * x.dtype.itemsize + int(np.prod(logits.shape)) * logits.dtype.itemsize
        return routed * experts.expert_nbytes(0) + activations

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        if args.get("activations") == "auto" and int(args["experts"].bits) == 4:
            raise ArgumentError("argument 'activations': 'auto' is chosen by a backend's front door; the reference "
                                "takes 'float' or 'int8' (backend.ops.prepare(...).args holds the choice)")
        int8 = int8_activations(args)
        x = np.asarray(args["hidden_states"]).astype(np.float64)
        experts: ExpertWeights = args["experts"]
        ids, weights = reference_routing(np.asarray(args["router_logits"]), int(args["top_k"]), routing_of(args))
        inter = experts.shape[2]
        out = np.zeros(x.shape, dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            for e in np.unique(ids):
                rows, slots = np.nonzero(ids == e)
                h = _project(x[rows], experts.w13[e], int8)
                gated = activate(h[:, :inter], activation_of(args)) * h[:, inter:]
                y = _project(gated, experts.w2[e], int8)
                np.add.at(out, rows, weights[rows, slots][:, None] * y)
        return out


def fused_moe_inputs(rng: np.random.Generator, *, num_tokens: int, num_experts: int, top_k: int, hidden: int,
                     intermediate: int, bits: int, group_size: int, dtype: str, logits_dtype: str | None = None,
                     symmetric: bool = True, routing: str | None = None,
                     activation: str | None = None) -> dict[str, Any]:
    """Host arguments: ``hidden_states`` in [-1, 1], logits ~ N(0, 4), float experts ~ N(0, 1/K) quantised by
    :func:`~hal_core.quant.quantize_experts`."""
    x = rng.uniform(-1.0, 1.0, (num_tokens, hidden)).astype(numpy_dtype(dtype))
    logits = (2.0 * rng.standard_normal((num_tokens, num_experts))).astype(numpy_dtype(logits_dtype or dtype))
    gate_up = rng.standard_normal((num_experts, hidden, 2 * intermediate)) / np.sqrt(hidden)
    down = rng.standard_normal((num_experts, intermediate, hidden)) / np.sqrt(intermediate)
    experts = quantize_experts(gate_up, down, bits=bits, group_size=group_size, symmetric=symmetric)
    args: dict[str, Any] = {"hidden_states": x, "router_logits": logits, "experts": experts, "top_k": top_k}
    if routing is not None:
        args["routing"] = routing
    if activation is not None:
        args["activation"] = activation
    return args


def _check_case(p: Mapping[str, Any]) -> str | None:
    if p["bits"] not in (4, 8):
        return f"bits must be 4 or 8, got {p['bits']}"
    if p.get("abits", 16) not in (0, 8, 16):
        return f"abits must be 16 (float), 8 (int8) or 0 ('auto'), got {p['abits']}"
    if p["top_k"] > p["experts"]:
        return f"top_k={p['top_k']} must be at most experts={p['experts']}"
    for name in ("hidden", "inter"):
        if p[name] % p["group"] or (p["bits"] == 4 and p[name] % 8):
            return f"{name}={p[name]} must be a multiple of group={p['group']} (and of 8 for bits=4)"
    return None


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    """Fast inputs: uniform activations and logits, experts of uniform random codes (no quantiser)."""
    e, hidden, inter = p["experts"], p["hidden"], p["inter"]
    experts = ExpertWeights(tuple(random_weight(rng, hidden, 2 * inter, p["bits"], p["group"]) for _ in range(e)),
                            tuple(random_weight(rng, inter, hidden, p["bits"], p["group"]) for _ in range(e)))
    return {"hidden_states": uniform(rng, (p["tokens"], hidden), p["dtype"]),
            "router_logits": uniform(rng, (p["tokens"], e), "fp32"), "experts": experts, "top_k": p["top_k"],
            **_activations(p)}


def _activations(p: Mapping[str, Any]) -> dict[str, str]:
    """The ``activations`` argument of a case: none for W4A16 and W8A8, ``'int8'`` for ``abits=8``, else ``'auto'``."""
    if p["bits"] != 4 or p.get("abits", 16) == 16:
        return {}
    return {"activations": "int8" if p["abits"] == 8 else "auto"}


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    return {**fused_moe_inputs(rng, num_tokens=p["tokens"], num_experts=p["experts"], top_k=p["top_k"],
                               hidden=p["hidden"], intermediate=p["inter"], bits=p["bits"], group_size=p["group"],
                               dtype=p["dtype"], logits_dtype="fp32"), **_activations(p)}


def _qwen3_moe(tokens: int, bits: int = 4, abits: int = 16) -> dict[str, Any]:
    """Qwen3-30B-A3B's MoE layer: 64 experts (top 8), hidden 2048, intermediate 768."""
    return {"tokens": tokens, "experts": 64, "top_k": 8, "hidden": 2048, "inter": 768, "bits": bits, "abits": abits,
            "group": 128, "dtype": "bf16"}


#: The presets' (bits, abits): W4A16, W4A8, W8A8.
_SCHEMES = ((4, 16), (4, 8), (8, 16))


def _activation_label(p: Mapping[str, Any]) -> str:
    """``A8`` / ``A-auto`` for int4 experts with int8 / automatic activations, nothing otherwise."""
    if p["bits"] != 4 or p.get("abits", 16) == 16:
        return ""
    return "A8" if p["abits"] == 8 else "A-auto"


FusedMoe.bench = BenchCases(
    params=_qwen3_moe(1),
    aliases={"num_tokens": "tokens", "num_experts": "experts", "intermediate_size": "inter",
             "group_size": "group"},
    may_be_zero=frozenset({"abits"}),
    label=lambda p: (f"fused_moe W{p['bits']}{_activation_label(p)} G{p['group']} {p['tokens']} tok {p['experts']}e "
                     f"top{p['top_k']} h{p['hidden']} i{p['inter']} {p['dtype']}"),
    check=_check_case,
    inputs=_bench_inputs,
    presets={
        "decode": lambda: [_qwen3_moe(t, bits, abits) for t in (1, 8) for bits, abits in _SCHEMES],
        "prefill": lambda: [_qwen3_moe(512, bits, abits) for bits, abits in _SCHEMES],
    },
    explain=({"tokens": 8, "experts": 8, "top_k": 2, "hidden": 256, "inter": 128, "bits": 4, "group": 64,
              "dtype": "bf16"},
             {"tokens": 1, "experts": 16, "top_k": 4, "hidden": 256, "inter": 128, "bits": 8, "group": 128,
              "dtype": "fp32"},
             {"tokens": 8, "experts": 8, "top_k": 2, "hidden": 256, "inter": 128, "bits": 4, "abits": 0,
              "group": 64, "dtype": "bf16"}),
    test_inputs=_test_inputs,
)

register_op(FusedMoe())
