"""hal-cpu's fused_moe: one GEMM per expert and projection, the numpy fallback, routing edge cases."""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hal_cpu import _abi, _native, set_threads
from hal_cpu.ops import _expert_mlps, fused_moe

from hal_core.ops import OPS
from hal_core.ops.fused_moe import ROUTINGS
from hal_core.quant import ExpertWeights
from hal_core.testing.inputs import assert_close, fused_moe_inputs

REFERENCE = OPS["fused_moe"].reference


def _args(rng: np.random.Generator, **overrides: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"num_tokens": 11, "num_experts": 16, "top_k": 4, "hidden": 96, "intermediate": 64,
                              "bits": 4, "group_size": 32, "dtype": "fp32"}
    return fused_moe_inputs(rng, **{**params, **overrides})


def _kind(bits: int) -> str:
    """The tolerance kind: int8 experts (W8A8) quantise the gated intermediate again, and a value within float32
    rounding of a code's tie may take the neighbouring code (see ``moe_w8a8`` in the tolerance table)."""
    return "gemm" if bits == 4 else "moe_w8a8"


def _moe(args: dict[str, Any]) -> np.ndarray:
    return fused_moe.moe(args["hidden_states"], args["router_logits"], args["experts"], args["top_k"],
                         args.get("routing") or "softmax_topk", args.get("activation") or "silu")


@pytest.mark.parametrize("native_call", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_each_expert_is_one_gemm_per_projection_over_all_its_tokens(rng: np.random.Generator,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    bits: int, native_call: bool) -> None:
    """Each routed expert's w13 and w2 are multiplied once, over exactly the rows of the tokens routed to it, in
    the one native call for experts of few rows (native_call) and in the loop of GEMM calls."""
    if native_call and _native.try_load() is None:
        pytest.skip("the compiled library is not built")
    args = _args(rng, bits=bits)
    calls: list[tuple[int, int]] = []
    real, real_launch = fused_moe.gemm, _expert_mlps.launch_for

    def counting(x: np.ndarray, weight: Any, **kwargs: Any) -> np.ndarray:
        calls.append((id(weight), x.shape[0]))
        return real(x, weight, **kwargs)

    def counting_launch(native: Any, x: np.ndarray, weight: Any, activations: str) -> Any:
        calls.append((id(weight), x.shape[0]))
        return real_launch(native, x, weight, activations)

    monkeypatch.setattr(fused_moe, "gemm", counting)
    monkeypatch.setattr(_expert_mlps, "launch_for", counting_launch)
    if not native_call:
        monkeypatch.setattr(_expert_mlps, "MAX_ROWS", 0)
    got = _moe(args)
    logits = args["router_logits"].astype(np.float64)
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :4]
    tokens_of = {e: int((chosen == e).sum()) for e in np.unique(chosen)}
    experts = args["experts"]
    expected = sorted([(id(experts.w13[e]), n) for e, n in tokens_of.items()]
                      + [(id(experts.w2[e]), n) for e, n in tokens_of.items()])
    assert sorted(calls) == expected
    assert_close(got, REFERENCE(args), kind=_kind(bits), dtype="fp32", what="fused_moe")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_numpy_fallback_matches_reference(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, bits: int,
                                          dtype: str) -> None:
    """Without the compiled library (numpy GEMM and activation) the result still matches float64."""
    monkeypatch.setattr(_native, "try_load", lambda: None)
    args = _args(rng, bits=bits, dtype=dtype, routing="topk_softmax")
    assert_close(_moe(args).astype(args["hidden_states"].dtype), REFERENCE(args), kind=_kind(bits), dtype=dtype)


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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("bits", "activations"), [(4, "float"), (4, "int8"), (8, "float")])
@pytest.mark.parametrize("tokens", [1, 6])
def test_the_native_call_gives_the_loops_bits(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                              request: pytest.FixtureRequest, tokens: int, bits: int,
                                              activations: str, dtype: str, threads: int) -> None:
    """Experts of few rows in one native call (one expert per thread) give the loop's bits at any thread count,
    for W4A16, W4A8 and W8A8; the call is taken (no GEMM call from Python)."""
    if _native.try_load() is None:
        pytest.skip("the compiled library is not built")
    previous = set_threads(threads)
    request.addfinalizer(lambda: set_threads(previous))
    args = _args(rng, num_tokens=tokens, bits=bits, dtype=dtype, top_k=4)
    call = (args["hidden_states"], args["router_logits"], args["experts"], 4, "softmax_topk", "silu", activations)
    python_gemms: list[int] = []
    real = fused_moe.gemm
    monkeypatch.setattr(fused_moe, "gemm", lambda *a, **k: python_gemms.append(1) or real(*a, **k))
    native = fused_moe.moe(*call)
    assert not python_gemms, "the experts ran one GEMM call at a time"
    monkeypatch.setattr(_expert_mlps, "MAX_ROWS", 0)
    np.testing.assert_array_equal(native, fused_moe.moe(*call))
    assert python_gemms


def test_a_non_finite_w4a16_result_takes_the_loop(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row holding inf: the in-register W4A16 kernel's rows are redone by the loop's GEMM, so the native call's
    result is dropped and the loop's (the reference's NaN and inf pattern) returned."""
    if _native.try_load() is None:
        pytest.skip("the compiled library is not built")
    args = _args(rng, num_tokens=3)
    args["hidden_states"][1, 5] = np.inf
    call = (args["hidden_states"], args["router_logits"], args["experts"], 4)
    got = fused_moe.moe(*call)
    monkeypatch.setattr(_expert_mlps, "MAX_ROWS", 0)
    np.testing.assert_array_equal(got, fused_moe.moe(*call))
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what="fused_moe with inf")


def test_act_order_int8_experts_in_the_native_call(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 experts with act-order: their W8A8 launches own a row order derived from g_idx (built per call, not
    kept); the native call holds them through the call and gives the loop's bits and the reference's values."""
    if _native.try_load() is None:
        pytest.skip("the compiled library is not built")
    args = _args(rng, num_tokens=2, bits=8)
    experts = args["experts"]

    def act_order(weight: Any) -> Any:
        k = weight.shape[0]
        g_idx = rng.permutation(np.arange(k) // weight.group_size).astype(np.int32)
        return replace(weight, g_idx=g_idx)

    args["experts"] = ExpertWeights(tuple(map(act_order, experts.w13)), tuple(map(act_order, experts.w2)))
    call = (args["hidden_states"], args["router_logits"], args["experts"], 4)
    python_gemms: list[int] = []
    real = fused_moe.gemm
    monkeypatch.setattr(fused_moe, "gemm", lambda *a, **k: python_gemms.append(1) or real(*a, **k))
    got = fused_moe.moe(*call)
    assert not python_gemms
    monkeypatch.setattr(_expert_mlps, "MAX_ROWS", 0)
    np.testing.assert_array_equal(got, fused_moe.moe(*call))
    assert_close(got, REFERENCE(args), kind="moe_w8a8", dtype="fp32", what="act-order int8 experts")


def _spy_on_routing_entry(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The return codes of every ``hal_cpu_moe_experts`` call from now on."""
    native = _native.try_load()
    if native is None:
        pytest.skip("the compiled library is not built")
    codes: list[int] = []
    real = native.lib.hal_cpu_moe_experts

    def spy(args: Any) -> int:
        codes.append(int(real(args)))
        return codes[-1]

    monkeypatch.setattr(native.lib, "hal_cpu_moe_experts", spy)
    return codes


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("bits", "activations"), [(4, "float"), (4, "int8"), (8, "float")])
@pytest.mark.parametrize("tokens", [1, 5])
def test_kept_structs_serve_later_calls_with_the_loops_bits(rng: np.random.Generator,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            request: pytest.FixtureRequest, tokens: int, bits: int,
                                                            activations: str, dtype: str, threads: int) -> None:
    """Once the experts' structs are kept, calls of new tokens and routings are one native entry from the routing
    (grouping, experts, combine) and give the loop's bits; an expert met for the first time (or at a new row
    count) is declined there and filled on the way, with the same bits."""
    previous = set_threads(threads)
    request.addfinalizer(lambda: set_threads(previous))
    args = _args(rng, num_tokens=tokens, bits=bits, dtype=dtype, top_k=3)
    experts = args["experts"]
    codes = _spy_on_routing_entry(monkeypatch)
    routings = [rng.standard_normal((tokens, 16)).astype(np.float32) * 2 for _ in range(2)]
    for step in range(6):  # each routing met first (its experts' structs kept), then again with new tokens
        x = fused_moe_inputs(rng, num_tokens=tokens, num_experts=16, top_k=3, hidden=96, intermediate=64, bits=bits,
                             group_size=32, dtype=dtype)["hidden_states"]
        call = (x, routings[step % 2], experts, 3, "softmax_topk_renorm", "gelu_tanh", activations)
        got = fused_moe.moe(*call)
        with monkeypatch.context() as loop:
            loop.setattr(_expert_mlps, "MAX_ROWS", 0)
            np.testing.assert_array_equal(got, fused_moe.moe(*call), err_msg=f"step {step}")
    assert codes.count(0) >= 4, f"the routing entry did not serve the repeated routings: {codes}"
    assert set(codes) <= {0, _abi.DECLINED}
    assert _expert_mlps.kept_tables(experts) >= 1


def test_the_routing_entry_declines_a_non_finite_w4a16_result(rng: np.random.Generator,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With the structs kept, a row holding inf is still redone by the loop (the reference's inf/NaN pattern)."""
    args = _args(rng, num_tokens=3)
    call = (args["hidden_states"], args["router_logits"], args["experts"], 4)
    fused_moe.moe(*call)  # keeps the hit experts' structs
    codes = _spy_on_routing_entry(monkeypatch)
    args["hidden_states"][1, 5] = np.inf
    got = fused_moe.moe(*call)
    assert codes and codes[0] == _abi.DECLINED
    with monkeypatch.context() as loop:
        loop.setattr(_expert_mlps, "MAX_ROWS", 0)
        np.testing.assert_array_equal(got, fused_moe.moe(*call))
    assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what="fused_moe with inf, structs kept")


def test_kept_structs_are_freed_with_their_experts(rng: np.random.Generator) -> None:
    """The tables live as long as their experts value, and a new value at a freed one's address starts empty."""
    if _native.try_load() is None:
        pytest.skip("the compiled library is not built")
    args = _args(rng, num_tokens=1)
    fused_moe.moe(args["hidden_states"], args["router_logits"], args["experts"], 4)
    assert _expert_mlps.kept_tables(args["experts"]) == 1
    key = id(args["experts"])
    del args["experts"]
    gc.collect()
    assert key not in _expert_mlps._SETS.entries
