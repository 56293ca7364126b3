"""fused_moe's ``activations``: int4 experts as W4A16 ('float'), W4A8 ('int8') or the backend's choice ('auto', the
rule of quantized_gemm on the call's tokens); opt-in per backend; expert layouts checked once per bound signature."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS, OpCoverage
from hal_core.ops.quantized_gemm import INT8_ACTIVATIONS_FROM_M
from hal_core.quant import ExpertWeights
from hal_core.testing.inputs import assert_close, fused_moe_inputs

SPEC = OPS["fused_moe"]


@pytest.fixture(autouse=True)
def store(private_tune_store: Path) -> Path:
    """A private, empty tune store (the built-in rule applies)."""
    return private_tune_store


@pytest.fixture
def cpu(int8_dot_cpu: hal_core.Backend) -> hal_core.Backend:
    """The CPU backend reporting int8 dot products (conftest's ``int8_dot_cpu``)."""
    return int8_dot_cpu


def _args(rng: np.random.Generator, tokens: int, *, bits: int = 4, dtype: str = "fp32") -> dict[str, Any]:
    return fused_moe_inputs(rng, num_tokens=tokens, num_experts=8, top_k=2, hidden=128, intermediate=64, bits=bits,
                            group_size=64, dtype=dtype, logits_dtype="fp32")


def _error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_int8_activations_run_the_int4_experts_as_w4a8(cpu, hal_rng: np.random.Generator, tokens: int,
                                                       dtype: str) -> None:
    """'int8' matches the W4A8 float64 reference, and is much closer to it than to W4A16's (an ignored setting gives
    W4A16's result); the CPU runs it itself (no fallback)."""
    args = _args(hal_rng, tokens, dtype=dtype)
    got = cpu.ops.fused_moe(**args, activations="int8")
    int8 = SPEC.reference({**args, "activations": "int8"})
    floats = SPEC.reference({**args, "activations": "float"})
    assert_close(got, int8, kind="moe_w8a8", dtype=dtype, what="fused_moe W4A8")
    if dtype == "fp32":  # bf16 rounding of the output hides the difference between the two
        assert _error(got, int8) < 0.25 * _error(got, floats), (_error(got, int8), _error(got, floats))
    plain = cpu.ops.fused_moe(**args)
    assert_close(plain, floats, kind="gemm", dtype=dtype, what="fused_moe W4A16")
    assert not cpu.ops.stats()["fused_moe"]["fallbacks"]


@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_auto_follows_the_rule_on_the_calls_tokens(cpu, hal_rng: np.random.Generator, tokens: int) -> None:
    """'auto' is W4A16 for one token and W4A8 from INT8_ACTIVATIONS_FROM_M tokens, bit for bit the explicit setting."""
    args = _args(hal_rng, tokens)
    want = "int8" if tokens >= INT8_ACTIVATIONS_FROM_M else "float"
    call = cpu.ops.prepare("fused_moe", **args, activations="auto")
    assert call.args["activations"] == want and "built-in rule" in call.settled
    got = cpu.ops.fused_moe(**args, activations="auto")
    np.testing.assert_array_equal(got, cpu.ops.fused_moe(**args, activations=want))


def test_auto_keeps_float_without_int8_dot_products(plain_cpu, hal_rng: np.random.Generator) -> None:
    """No 'int8_dot' on the device: 'auto' is float at every token count, saying why."""
    args = _args(hal_rng, 8)
    call = plain_cpu.ops.prepare("fused_moe", **args, activations="auto")
    assert call.args["activations"] == "float" and "'int8_dot'" in call.settled


def test_auto_keeps_float_without_w4a8_declared(cpu, hal_rng: np.random.Generator) -> None:
    """No W4A8 declared for fused_moe: 'auto' is float, saying why; int8 experts are W8A8 whatever 'auto' would
    say."""
    args = _args(hal_rng, 8)
    settled = {**args, "activations": "auto"}
    note = SPEC.settle(settled, cpu, 0, OpCoverage(bits=(4, 8)))
    assert settled["activations"] == "float" and "does not declare W4A8" in (note or "")
    eight = {**_args(hal_rng, 8, bits=8), "activations": "auto"}
    note = SPEC.settle(eight, cpu, 0, cpu.ops.coverage("fused_moe"))
    assert eight["activations"] == "int8" and "W8A8" in (note or "")


def test_w4a8_is_opt_in_per_backend(cpu, hal_rng: np.random.Generator) -> None:
    """A backend whose coverage does not name 'w4a8' for fused_moe is never given an int8-activation call (the front
    door falls back); the CPU declares it."""
    args = {**_args(hal_rng, 3), "activations": "int8"}
    reason = OpCoverage(bits=(4, 8), group_sizes=(64, 128)).undeclared_opt_in(SPEC, args)
    assert reason is not None and "'w4a8'" in reason
    assert cpu.ops.coverage("fused_moe").undeclared_opt_in(SPEC, args) is None
    assert OpCoverage(bits=(4, 8)).undeclared_opt_in(SPEC, {**args, "activations": "float"}) is None


def test_bucket_and_reference_name_the_setting(hal_rng: np.random.Generator) -> None:
    """The tune bucket tells W4A8 apart; the reference refuses an unsettled 'auto' naming the argument; a misspelt
    value is refused before any work."""
    args = _args(hal_rng, 5)
    assert SPEC.bucket({**args, "activations": "int8"}) == "w4a8:t8"
    assert SPEC.bucket(args) == "w4:t8"
    with pytest.raises(ArgumentError, match="'activations'"):
        SPEC.reference({**args, "activations": "auto"})
    with pytest.raises(ArgumentError, match="'activations'"):
        hal_core.get_backend("cpu").ops.fused_moe(**args, activations="int4")


def test_a_bound_op_checks_the_expert_layouts_once_per_signature(cpu, hal_rng: np.random.Generator,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The O(experts) layout check runs on every front-door call but once per signature of a bound op, whose
    results equal the front door's; values changed in place still reach the next call."""
    args = _args(hal_rng, 4)
    seen: list[int] = []
    original = type(SPEC).check_layout

    def counted(self: Any, call_args: dict[str, Any], sizes: Any) -> None:
        seen.append(1)
        original(self, call_args, sizes)

    monkeypatch.setattr(type(SPEC), "check_layout", counted)
    bound = cpu.ops.bind("fused_moe", experts=args["experts"], top_k=2, activations="int8")
    first = bound(hidden_states=args["hidden_states"], router_logits=args["router_logits"])
    second = bound(hidden_states=args["hidden_states"], router_logits=args["router_logits"])
    assert len(seen) == 1
    front = cpu.ops.fused_moe(**args, activations="int8")
    cpu.ops.fused_moe(**args, activations="int8")
    assert len(seen) == 3
    np.testing.assert_array_equal(first, front)
    np.testing.assert_array_equal(second, front)
    args["experts"].w2[0].scales[...] *= 2  # in place: read by the next call
    changed = bound(hidden_states=args["hidden_states"], router_logits=args["router_logits"])
    np.testing.assert_array_equal(changed, cpu.ops.fused_moe(**args, activations="int8"))


def test_a_bound_op_refuses_a_bad_expert_layout_naming_it(cpu, hal_rng: np.random.Generator) -> None:
    """An expert array of the wrong dtype or order is refused by the bound op's first call, naming the expert."""
    args = _args(hal_rng, 2)
    experts: ExpertWeights = args["experts"]
    w13 = list(experts.w13)
    w13[3] = replace(w13[3], scales=np.asfortranarray(w13[3].scales))
    bad_order = ExpertWeights(tuple(w13), experts.w2)
    w2 = list(experts.w2)
    w2[5] = replace(w2[5], qweight=w2[5].qweight.astype(np.int32))
    bad_dtype = ExpertWeights(experts.w13, tuple(w2))
    with pytest.raises(ArgumentTypeError, match=r"'experts\.w2\[5\]\.qweight'"):
        cpu.ops.bind("fused_moe", experts=bad_dtype, top_k=2)(hidden_states=args["hidden_states"],
                                                               router_logits=args["router_logits"])
    with pytest.raises((ArgumentError, ArgumentTypeError), match=r"experts\.w13\[3\]"):
        cpu.ops.bind("fused_moe", experts=bad_order, top_k=2)(hidden_states=args["hidden_states"],
                                                               router_logits=args["router_logits"])


def test_the_front_door_checks_each_experts_value_once(cpu, hal_rng: np.random.Generator,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Front-door calls check an ``ExpertWeights`` value's arrays on its first call only (the value is frozen); a
    value of the same shapes with a bad array is still refused naming it, every time, and a good one after it
    computes the reference's result."""
    import gc

    import hal_core.ops.fused_moe as declaration

    checked: list[str] = []
    real = declaration.check_weight_layout
    monkeypatch.setattr(declaration, "check_weight_layout", lambda w, name: (checked.append(name), real(w, name)))
    args = _args(hal_rng, 2)
    first = cpu.ops.fused_moe(**args)
    per_value = len(checked)
    assert per_value == 2 * args["experts"].num_experts
    again = cpu.ops.fused_moe(**args)
    assert len(checked) == per_value
    np.testing.assert_array_equal(first, again)
    experts: ExpertWeights = args["experts"]
    w2 = list(experts.w2)
    w2[5] = replace(w2[5], qweight=w2[5].qweight.astype(np.int32))
    bad = ExpertWeights(experts.w13, tuple(w2))
    for _ in range(2):
        with pytest.raises(ArgumentTypeError, match=r"'experts\.w2\[5\]\.qweight'"):
            cpu.ops.fused_moe(**{**args, "experts": bad})
    del bad
    gc.collect()
    fresh = ExpertWeights(experts.w13, experts.w2)  # possibly at a freed value's address: checked anew
    checked.clear()
    np.testing.assert_array_equal(cpu.ops.fused_moe(**{**args, "experts": fresh}), first)
    assert len(checked) == per_value
