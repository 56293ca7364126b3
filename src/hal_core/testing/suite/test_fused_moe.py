"""fused_moe (int4 and int8 experts, every routing) against the float64 reference, plus edge cases and errors."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.ops.fused_moe import ROUTINGS
from hal_core.ops.gated_activation import activate
from hal_core.quant import ExpertWeights
from hal_core.testing.inputs import assert_close, fused_moe_inputs, to_backend

REFERENCE = OPS["fused_moe"].reference
_KEYWORDS = ("top_k", "routing", "activation")


def _run(backend: Any, args: dict[str, Any], out: Any = None) -> np.ndarray:
    dev = to_backend(backend, "fused_moe", args)
    keywords = {name: args[name] for name in _KEYWORDS if name in args}
    result = backend.ops.fused_moe(dev["hidden_states"], dev["router_logits"], dev["experts"], out=out, **keywords)
    return backend.to_numpy(result)


def _inputs(rng: np.random.Generator, **overrides: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"num_tokens": 5, "num_experts": 8, "top_k": 2, "hidden": 128, "intermediate": 64,
                              "bits": 4, "group_size": 64, "dtype": "fp32"}
    return fused_moe_inputs(rng, **{**params, **overrides})


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(("top_k", "num_experts"), [(1, 8), (2, 8), (8, 8), (8, 64)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_matches_reference(hal_backend: Any, hal_rng: np.random.Generator, bits: int, dtype: str,
                                     top_k: int, num_experts: int, routing: str, num_tokens: int) -> None:
    """int4 and int8 experts, fp32 and bf16 activations, top-1/2/8 of 8 or 64 experts, every routing, match float64."""
    args = _inputs(hal_rng, num_tokens=num_tokens, num_experts=num_experts, top_k=top_k, bits=bits, dtype=dtype,
                   routing=routing)
    got = _run(hal_backend, args)
    assert got.dtype == args["hidden_states"].dtype
    assert_close(got, REFERENCE(args), kind="gemm" if bits == 4 else "moe_w8a8", dtype=dtype,
                 what=f"fused_moe int{bits} {routing}")


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_fused_moe_activations_zero_points_fp32_logits(hal_backend: Any, hal_rng: np.random.Generator,
                                                       activation: str) -> None:
    """GELU activations, experts with zero points, fp16 hidden states with fp32 logits match float64."""
    args = _inputs(hal_rng, num_tokens=9, dtype="fp16", logits_dtype="fp32", symmetric=False, activation=activation)
    assert_close(_run(hal_backend, args), REFERENCE(args), kind="gemm", dtype="fp16", what=f"fused_moe {activation}")


def _mlp(x: np.ndarray, experts: ExpertWeights, e: int) -> np.ndarray:
    """Expert ``e``'s SiLU-gated MLP of float64 rows (int4 weights, no activation quantisation)."""
    w13, w2 = experts.w13[e].dequantize(), experts.w2[e].dequantize()
    inter = w2.shape[0]
    h = x @ w13
    return (activate(h[:, :inter], "silu") * h[:, inter:]) @ w2


def test_fused_moe_ties_go_to_the_lowest_expert(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """Equal logits route to experts 0..top_k-1, each weighted 1/num_experts (softmax_topk, no renormalising)."""
    args = _inputs(hal_rng, num_tokens=4, num_experts=8, top_k=3)
    args["router_logits"] = np.full((4, 8), 0.25, np.float32)
    x = args["hidden_states"].astype(np.float64)
    expected = np.sum([_mlp(x, args["experts"], e) / 8 for e in range(3)], axis=0)
    assert_close(_run(hal_backend, args), expected, kind="gemm", dtype="fp32", what="fused_moe tied logits")


def test_fused_moe_experts_without_tokens_are_not_read(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """Experts no token routes to may hold NaN scales: the result is finite and matches the reference."""
    args = _inputs(hal_rng, num_tokens=6, num_experts=8, top_k=2, routing="softmax_topk_renorm")
    logits = np.full((6, 8), -4.0, np.float32)
    logits[:, 1], logits[:, 5] = 3.0, 2.0
    logits[::2, 5] = -1.0  # so every other token ranks expert 5 second at a lower weight
    args["router_logits"] = logits + hal_rng.uniform(0, 0.5, logits.shape).astype(np.float32)
    experts: ExpertWeights = args["experts"]
    poisoned = [replace(w, scales=np.full(w.scales.shape, np.nan, w.scales.dtype)) for w in experts.w13]
    keep = {1, 5}
    args["experts"] = ExpertWeights(tuple(w if e in keep else poisoned[e] for e, w in enumerate(experts.w13)),
                                    experts.w2)
    got = _run(hal_backend, args)
    assert np.isfinite(got).all()
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what="fused_moe unused experts")


def test_fused_moe_writes_out_and_no_tokens(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """With out=, the result lands in out and out is returned; zero tokens give an empty [0, hidden] result."""
    args = _inputs(hal_rng, num_tokens=3, bits=8)
    dev = to_backend(hal_backend, "fused_moe", args)
    out = hal_backend.asarray(np.zeros((3, 128), np.float32))
    result = hal_backend.ops.fused_moe(dev["hidden_states"], dev["router_logits"], dev["experts"], top_k=2, out=out)
    assert result is out
    assert_close(hal_backend.to_numpy(out), REFERENCE(args), kind="gemm", dtype="fp32")
    empty = _inputs(hal_rng, num_tokens=0, dtype="bf16")
    got = _run(hal_backend, empty)
    assert got.shape == (0, 128) and got.dtype == empty["hidden_states"].dtype


BAD_INPUTS = [
    ("hidden-rank", ArgumentError, "hidden_states"),
    ("hidden-dtype", ArgumentTypeError, "hidden_states"),
    ("hidden-size", ArgumentError, "hidden_states"),
    ("logits-experts", ArgumentError, "router_logits"),
    ("logits-tokens", ArgumentError, "router_logits"),
    ("logits-dtype", ArgumentTypeError, "router_logits"),
    ("experts-type", ArgumentTypeError, "experts"),
    ("expert-scales-dtype", ArgumentTypeError, "experts.w13[3].scales"),
    ("expert-qweight-dtype", ArgumentTypeError, "experts.w2[5].qweight"),
    ("top-k-zero", ArgumentError, "top_k"),
    ("top-k-too-large", ArgumentError, "top_k"),
    ("top-k-float", ArgumentTypeError, "top_k"),
    ("top-k-missing", ArgumentTypeError, "top_k"),
    ("routing", ArgumentError, "routing"),
    ("activation", ArgumentError, "activation"),
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_fused_moe_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str, error: type[Exception],
                             argument: str) -> None:
    """Bad input raises the right error naming the argument (and expert) and leaves out untouched."""
    args = _inputs(hal_rng, num_tokens=4, dtype="bf16")
    experts: ExpertWeights = args["experts"]
    if case == "hidden-rank":
        args["hidden_states"] = args["hidden_states"][0]
    elif case == "hidden-dtype":
        args["hidden_states"] = args["hidden_states"].astype(np.int32)
    elif case == "hidden-size":
        args["hidden_states"] = args["hidden_states"][:, :64].copy()
    elif case == "logits-experts":
        args["router_logits"] = args["router_logits"][:, :7].copy()
    elif case == "logits-tokens":
        args["router_logits"] = args["router_logits"][:3].copy()
    elif case == "logits-dtype":
        args["router_logits"] = args["router_logits"].astype(np.float16)
    elif case == "experts-type":
        args["experts"] = experts.w13[0]
    elif case == "expert-scales-dtype":
        w13 = list(experts.w13)
        w13[3] = replace(w13[3], scales=np.ones(w13[3].scales.shape, np.int32))
        args["experts"] = ExpertWeights(tuple(w13), experts.w2)
    elif case == "expert-qweight-dtype":
        w2 = list(experts.w2)
        w2[5] = replace(w2[5], qweight=w2[5].qweight.astype(np.int32))
        args["experts"] = ExpertWeights(experts.w13, tuple(w2))
    elif case.startswith("top-k"):
        top_k = {"top-k-zero": 0, "top-k-too-large": 9, "top-k-float": 2.0, "top-k-missing": None}[case]
        args["top_k"] = top_k
    else:
        args[case] = "relu"
    sentinel = np.full((4, 128), 7.0, args["hidden_states"].dtype if case != "hidden-dtype" else np.float32)
    out = hal_backend.asarray(sentinel)
    dev = to_backend(hal_backend, "fused_moe", args) if case != "experts-type" else {
        **args, "hidden_states": hal_backend.asarray(args["hidden_states"]),
        "router_logits": hal_backend.asarray(args["router_logits"])}
    keywords = {name: args[name] for name in _KEYWORDS if name in args}
    with pytest.raises(error) as info:
        hal_backend.ops.fused_moe(dev["hidden_states"], dev["router_logits"], dev["experts"], out=out, **keywords)
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    np.testing.assert_array_equal(hal_backend.to_numpy(out), sentinel, err_msg="out was modified")


@pytest.mark.parametrize(("field", "what"), [("w13", "shape"), ("w2", "bits"), ("w2", "group_size")])
def test_expert_weights_refuse_mismatched_experts(hal_rng: np.random.Generator, field: str, what: str) -> None:
    """ExpertWeights refuses an expert whose shape, bits or group size differs from expert 0's, naming it."""
    experts: ExpertWeights = _inputs(hal_rng, num_experts=4)["experts"]
    other = _inputs(hal_rng, num_experts=4, hidden=64 if what == "shape" else 128,
                    bits=8 if what == "bits" else 4, group_size=32 if what == "group_size" else 64)["experts"]
    parts = {"w13": list(experts.w13), "w2": list(experts.w2)}
    parts[field][2] = getattr(other, field)[2]
    with pytest.raises(ValueError, match=rf"{field}\[2\] has {what}"):
        ExpertWeights(tuple(parts["w13"]), tuple(parts["w2"]))


def test_expert_weights_refuse_unequal_counts_and_shapes(hal_rng: np.random.Generator) -> None:
    """ExpertWeights refuses w13 and w2 lists of different lengths, or a w2 not [intermediate, hidden]."""
    experts: ExpertWeights = _inputs(hal_rng, num_experts=3)["experts"]
    with pytest.raises(ValueError, match="w13 has 3 experts but w2 has 2"):
        ExpertWeights(experts.w13, experts.w2[:2])
    with pytest.raises(ValueError, match=r"w2\[0\] must have shape"):
        ExpertWeights(experts.w13, experts.w13)
