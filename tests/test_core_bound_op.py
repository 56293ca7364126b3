"""Ops.bind: an op with some arguments fixed answers what the front door answers, with every check, fallback and
count, on the first call of a signature and on the next ones."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS, BoundOp, OpImpl
from hal_core.ops._bound import MAX_SIGNATURES
from hal_core.quant import QuantizedWeight, quantize


def _tiny(op: str, rng: np.random.Generator) -> dict[str, Any]:
    bench = OPS[op].bench
    assert bench is not None and bench.tiny is not None
    return bench.inputs(rng, {**bench.params, **bench.tiny})


def _weight(rng: np.random.Generator, k: int = 64, n: int = 24) -> Any:
    return quantize(rng.standard_normal((k, n)).astype(np.float32), bits=4, group_size=32)


def _gemm_calls(backend: hal_core.Backend) -> int:
    return int(backend.ops.stats().get("quantized_gemm", {}).get("calls", 0))


@pytest.mark.parametrize("op", sorted(op for op, spec in OPS.items() if spec.bench and spec.bench.tiny))
def test_every_op_bound_gives_the_front_doors_bits(cpu: hal_core.Backend, op: str, hal_rng: np.random.Generator,
                                                   hal_seed: int) -> None:
    """Each op's tiny case with every argument but its first array bound: the result (and what an in-place op
    writes) equals the front door's bit for bit, on a signature's first call and on the next, with fresh values."""
    print(f"seed={hal_seed}")
    spec = OPS[op]
    args = _tiny(op, hal_rng)
    first = spec.array_names[0]
    fixed = {name: value for name, value in args.items() if name != first}
    bound = cpu.ops.bind(op, **fixed)
    for round_ in range(3):
        if round_:  # fresh values in the free array, same signature
            args[first] = hal_rng.standard_normal(args[first].shape).astype(args[first].dtype) \
                if args[first].dtype.kind == "f" else args[first]
        door_args, bound_args = copy.deepcopy(args), copy.deepcopy(args)
        want = getattr(cpu.ops, op)(**door_args)
        fixed_copy = {name: value for name, value in bound_args.items() if name != first}
        rebound = cpu.ops.bind(op, **fixed_copy) if spec.inplace_args else bound
        got = rebound(**{first: bound_args[first]})
        if want is None:
            assert got is None
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert np.asarray(got).dtype == np.asarray(want).dtype
        for name in spec.inplace_args:
            np.testing.assert_array_equal(bound_args[name], door_args[name])
    assert bound.signature_count() == (0 if spec.inplace_args else 1)


def test_quantized_gemm_bound_matches_float64_and_counts_each_call(cpu: hal_core.Backend,
                                                                   hal_rng: np.random.Generator, hal_seed: int) -> None:
    print(f"seed={hal_seed}")
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    assert isinstance(bound, BoundOp) and bound.op == "quantized_gemm" and bound.backend is cpu
    before = _gemm_calls(cpu)
    for m in (1, 3, 1, 5):
        x = hal_rng.standard_normal((m, 64)).astype(np.float32)
        expected = x.astype(np.float64) @ w.dequantize(np.float64)
        np.testing.assert_allclose(bound(x=x), expected, rtol=1e-4, atol=1e-4)
    assert _gemm_calls(cpu) == before + 4
    assert bound.signature_count() == 3


def test_a_bad_argument_is_refused_naming_it_on_every_call(cpu: hal_core.Backend,
                                                           hal_rng: np.random.Generator) -> None:
    """A wrong shape or dtype after good calls of the same bound op is still refused, as the front door does."""
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    bound(x=np.ones((2, 64), np.float32))
    with pytest.raises(ArgumentError, match="'x'"):
        bound(x=np.ones((2, 63), np.float32))
    with pytest.raises(ArgumentTypeError, match="'x'"):
        bound(x=np.ones((2, 64), np.int32))
    with pytest.raises(ArgumentError, match="'x'"):
        bound(x=np.ones((4, 128), np.float32)[:, ::2])  # strided rows: a new signature, checked in full
    with pytest.raises(ArgumentError, match="'activations'"):
        bound(x=np.ones((2, 64), np.float32), activations="int4")
    with pytest.raises(TypeError, match="'qweight' is bound already"):
        bound(x=np.ones((2, 64), np.float32), qweight=w)
    with pytest.raises(TypeError, match="'bias'"):
        bound(x=np.ones((2, 64), np.float32), bias=None)


def test_bind_checks_what_it_can_at_once(cpu: hal_core.Backend, hal_rng: np.random.Generator) -> None:
    w = _weight(hal_rng)
    with pytest.raises(ArgumentError, match="argument 'op'"):
        cpu.ops.bind("no_such_op", qweight=w)
    with pytest.raises(TypeError, match="'weight'"):
        cpu.ops.bind("quantized_gemm", weight=w)
    with pytest.raises(ArgumentError, match="'out'"):
        cpu.ops.bind("quantized_gemm", qweight=w, out=np.empty((1, 24), np.float32))
    with pytest.raises(ArgumentError, match="'activations'"):
        cpu.ops.bind("quantized_gemm", qweight=w, activations="int4")


def test_values_are_read_on_every_call(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                       hal_seed: int) -> None:
    """A fixed weight's arrays changed in place reach the next call; an act-order index made invalid in place is
    refused (the op's own checks run on every call of a kept signature)."""
    print(f"seed={hal_seed}")
    plain = _weight(hal_rng)
    w = QuantizedWeight(qweight=plain.qweight, scales=plain.scales, zeros=None, bits=4, group_size=32,
                        shape=plain.shape, g_idx=hal_rng.permutation(np.arange(64) // 32).astype(np.int32))
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    x = hal_rng.standard_normal((2, 64)).astype(np.float32)
    bound(x=x)
    w.scales[...] *= 2
    np.testing.assert_allclose(bound(x=x), x.astype(np.float64) @ w.dequantize(np.float64), rtol=1e-4, atol=1e-4)
    w.g_idx[3] = 7
    with pytest.raises(ArgumentError, match="g_idx"):
        bound(x=x)


def test_out_is_written_and_foreign_arrays_take_the_front_door(cpu: hal_core.Backend,
                                                               hal_rng: np.random.Generator) -> None:
    """``out`` given per call is checked and written as the front door does (a read-only or wrongly shaped one
    refused before any work); a torch tensor goes through the front door (and comes back a tensor)."""
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    x = hal_rng.standard_normal((3, 64)).astype(np.float32)
    want = cpu.ops.quantized_gemm(x, w)
    for _ in range(2):  # the signature's first call, then a kept one
        out = np.full((3, 24), np.nan, np.float32)
        assert bound(x=x, out=out) is out
        np.testing.assert_array_equal(out, want)
    assert bound.signature_count() == 1
    read_only = np.zeros((3, 24), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ArgumentError, match="'out'"):
        bound(x=x, out=read_only)
    with pytest.raises(ArgumentError, match="'out'"):
        bound(x=x, out=np.zeros((3, 25), np.float32))
    torch = pytest.importorskip("torch")
    got = bound(x=torch.from_numpy(x))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), want)
    assert bound.signature_count() == 1  # neither the refused shape nor the torch call kept one


def test_hints_are_normalised_on_every_call_of_a_signature(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                           hal_seed: int) -> None:
    """paged_attention's hints enter a signature by type: a decode step's growing max_seq_len keeps one signature,
    each call answers like the front door, and a bad hint is still refused."""
    print(f"seed={hal_seed}")
    from hal_core.testing.inputs import paged_attention_inputs

    args = paged_attention_inputs(hal_rng, seq_lens=[9, 5], num_heads=4, num_kv_heads=2, head_size=64,
                                  block_size=16, dtype="fp32")
    fixed = {name: args[name] for name in ("key_cache", "value_cache")}
    bound = cpu.ops.bind("paged_attention", **fixed)
    for extra in range(3):
        args["seq_lens"] = args["seq_lens"] + (extra > 0)
        given = {name: value for name, value in args.items() if name not in fixed}
        want = cpu.ops.paged_attention(**args, max_seq_len=int(args["seq_lens"].max()))
        got = bound(**given, max_seq_len=int(args["seq_lens"].max()))
        np.testing.assert_array_equal(got, want)
    assert bound.signature_count() == 1
    with pytest.raises((ArgumentError, ArgumentTypeError), match="'max_seq_len'"):
        bound(**given, max_seq_len=0)


def test_signatures_are_bounded(cpu: hal_core.Backend, hal_rng: np.random.Generator) -> None:
    bound = cpu.ops.bind("quantized_gemm", qweight=_weight(hal_rng))
    for m in range(1, MAX_SIGNATURES + 5):
        bound(x=np.ones((m, 64), np.float32))
    assert bound.signature_count() == MAX_SIGNATURES


def test_a_new_implementation_is_seen_and_its_fault_falls_back(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An implementation registered after a signature was kept takes the next call; when it raises, the call falls
    back (counted, watched) with the right result, and HAL_STRICT=1 makes that an error."""
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    x = hal_rng.standard_normal((2, 64)).astype(np.float32)
    want = bound(x=x)
    ran: list[int] = []

    def broken(call: Any) -> Any:
        ran.append(1)
        raise RuntimeError("broken kernel")

    cpu.ops.registry.register(OpImpl(op="quantized_gemm", fn=broken, name="broken", priority=10**9))
    with cpu.ops.watch() as events:
        got = bound(x=x)
    assert ran and [e.kind for e in events] == ["fault", "fallback"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert "broken: raised RuntimeError: broken kernel" in " ".join(cpu.ops.stats()["quantized_gemm"]["fallbacks"])
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(hal_core.ImplementationError, match="broken"):
        bound(x=x)


def test_a_supports_predicate_is_asked_on_every_call(cpu: hal_core.Backend, hal_rng: np.random.Generator) -> None:
    """Where an implementation has a supports() predicate, the choice is not kept: the predicate's answer on each
    call decides (here a switch flipped between calls of one signature)."""
    w = _weight(hal_rng)
    bound = cpu.ops.bind("quantized_gemm", qweight=w)
    x = hal_rng.standard_normal((2, 64)).astype(np.float32)
    want = bound(x=x)
    switch = {"on": True}
    cpu.ops.registry.register(OpImpl(op="quantized_gemm", fn=lambda call: np.zeros((2, 24), np.float32),
                                     name="zeros", priority=10**9,
                                     supports=lambda call: True if switch["on"] else "switched off"))
    np.testing.assert_array_equal(bound(x=x), np.zeros((2, 24), np.float32))
    switch["on"] = False
    np.testing.assert_array_equal(bound(x=x), want)


def test_a_bound_options_value_cannot_be_given_again(cpu: hal_core.Backend, hal_rng: np.random.Generator) -> None:
    """paged_attention bound with ``options``: a call giving ``options`` or one of its fields again is refused."""
    from hal_core import AttentionOptions
    from hal_core.testing.inputs import paged_attention_inputs

    args = paged_attention_inputs(hal_rng, seq_lens=[4], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                                  dtype="fp32")
    options = AttentionOptions(scale=0.125)
    bound = cpu.ops.bind("paged_attention", key_cache=args["key_cache"], value_cache=args["value_cache"],
                         options=options)
    rest = {name: value for name, value in args.items() if name not in ("key_cache", "value_cache", "scale")}
    np.testing.assert_array_equal(bound(**rest), cpu.ops.paged_attention(**rest, key_cache=args["key_cache"],
                                                                         value_cache=args["value_cache"],
                                                                         options=options))
    for again in ({"options": options}, {"scale": 0.5}):
        with pytest.raises(TypeError, match="bound already"):
            bound(**rest, **again)
