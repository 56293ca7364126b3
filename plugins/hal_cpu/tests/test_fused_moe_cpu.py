"""hal-cpu's fused_moe: one GEMM per expert and projection, the numpy fallback, routing edge cases."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import fused_moe

from hal_core.ops import OPS
from hal_core.ops.fused_moe import ROUTINGS
from hal_core.testing.inputs import assert_close, fused_moe_inputs

REFERENCE = OPS["fused_moe"].reference


def _args(rng: np.random.Generator, **overrides: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"num_tokens": 11, "num_experts": 16, "top_k": 4, "hidden": 96, "intermediate": 64,
                              "bits": 4, "group_size": 32, "dtype": "fp32"}
    return fused_moe_inputs(rng, **{**params, **overrides})


def _moe(args: dict[str, Any]) -> np.ndarray:
    return fused_moe.moe(args["hidden_states"], args["router_logits"], args["experts"], args["top_k"],
                         args.get("routing") or "softmax_topk", args.get("activation") or "silu")


@pytest.mark.parametrize("bits", [4, 8])
def test_each_expert_is_one_gemm_per_projection_over_all_its_tokens(rng: np.random.Generator,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    bits: int) -> None:
    """Each routed expert's w13 and w2 are multiplied once, over exactly the rows of the tokens routed to it."""
    args = _args(rng, bits=bits)
    calls: list[tuple[int, int]] = []
    real = fused_moe.gemm

    def counting(x: np.ndarray, weight: Any, **kwargs: Any) -> np.ndarray:
        calls.append((id(weight), x.shape[0]))
        return real(x, weight, **kwargs)

    monkeypatch.setattr(fused_moe, "gemm", counting)
    got = _moe(args)
    logits = args["router_logits"].astype(np.float64)
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :4]
    tokens_of = {e: int((chosen == e).sum()) for e in np.unique(chosen)}
    experts = args["experts"]
    expected = sorted([(id(experts.w13[e]), n) for e, n in tokens_of.items()]
                      + [(id(experts.w2[e]), n) for e, n in tokens_of.items()])
    assert sorted(calls) == expected
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what="fused_moe")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_numpy_fallback_matches_reference(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, bits: int,
                                          dtype: str) -> None:
    """Without the compiled library (numpy GEMM and activation) the result still matches float64."""
    monkeypatch.setattr(_native, "try_load", lambda: None)
    args = _args(rng, bits=bits, dtype=dtype, routing="topk_softmax")
    assert_close(_moe(args).astype(args["hidden_states"].dtype), REFERENCE(args), kind="gemm", dtype=dtype)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_nan_logit(rng: np.random.Generator, routing: str) -> None:
    """A NaN logit makes its token's row NaN under the softmax_topk modes; topk_softmax never selects it (as the
    reference); the other tokens are untouched."""
    args = _args(rng, routing=routing)
    args["router_logits"][3, 5] = np.nan
    got = _moe(args)
    expected = REFERENCE(args)
    assert_close(got, expected, kind="gemm", dtype="fp32")
    assert np.isnan(expected[3]).all() == (routing != "topk_softmax")
    assert np.isfinite(np.delete(expected, 3, axis=0)).all()


def test_route_weights_and_order(rng: np.random.Generator) -> None:
    """route() returns the largest logits first and weights that match the float64 softmax rules."""
    logits = rng.standard_normal((7, 10)).astype(np.float32)
    for routing in ROUTINGS:
        ids, weights = fused_moe.route(logits, 3, routing)
        want = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :3]
        np.testing.assert_array_equal(ids, want)
        probs = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True)
        picked = np.take_along_axis(probs, want, axis=1)
        expected = picked if routing == "softmax_topk" else picked / picked.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(weights, expected, rtol=1e-6, atol=1e-7)


def _grouped(args: dict[str, Any], activations: str) -> np.ndarray:
    """The grouped loop spelt out for one token: each routed expert in expert order, its weighted output added."""
    experts, x = args["experts"], args["hidden_states"]
    inter = experts.shape[2]
    ids, weights = fused_moe.route(args["router_logits"], args["top_k"], "softmax_topk")
    out = np.zeros(x.shape, np.float32)
    for e in sorted(ids[0].tolist()):
        h = fused_moe.gemm(x[[0]], experts.w13[e], activations=activations)
        y = fused_moe.gemm(fused_moe.gated(h[:, :inter], h[:, inter:], "silu"), experts.w2[e],
                           activations=activations)
        y *= weights[0][ids[0] == e][:, None]
        out[[0]] += y
    return out


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("bits", [4, 8])
def test_one_token_gives_the_grouped_loops_bits(rng: np.random.Generator, bits: int, activations: str) -> None:
    """A one-token call (its own loop, no grouping) gives the bits of the grouped loop's operations, and the
    float64 reference's values."""
    args = _args(rng, num_tokens=1, bits=bits)
    got = fused_moe.moe(args["hidden_states"], args["router_logits"], args["experts"], args["top_k"],
                        activations=activations)
    np.testing.assert_array_equal(got, _grouped(args, activations))
    int8 = bits == 8 or activations == "int8"
    assert_close(got, REFERENCE({**args, "activations": activations}), kind="moe_w8a8" if int8 else "gemm",
                 dtype="fp32", what=f"one token, int{bits}, {activations}")
