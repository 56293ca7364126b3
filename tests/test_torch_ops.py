"""torch.ops.hal: opcheck over shapes and dtypes, results against float64 references, errors, routing, lazy import."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from torch_helpers import TORCH_DTYPES, cuda_or_skip, host, tensor, torch

import hal_core
import hal_core.torch as hal_torch
import hal_core.torch._ops as hal_torch_ops
from hal_core.ops import OPS
from hal_core.testing.inputs import (
    assert_close,
    paged_attention_inputs,
    quantized_gemm_inputs,
    write_kv_cache_inputs,
)

DTYPES = ("fp32", "fp16", "bf16")
DEVICES = ("cpu", "cuda")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda":
        cuda_or_skip()
    return request.param


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its NaN poison replaced by zeros (opcheck compares runs with ``==``)."""
    return torch.nan_to_num(t, nan=0.0) if t.is_floating_point() else t


def test_import_hal_core_imports_no_torch() -> None:
    code = ("import sys, hal_core, hal_core.ops, hal_core.quant, hal_core.kvcache; hal_core.get_backend(); "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "import hal_core.torch; assert 'torch' in sys.modules; assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- paged_attention ---------------------------------------------------------------

ATTENTION_CASES = [  # seq_lens, heads, kv_heads, head_size, block_size
    ((5, 17, 1), 4, 2, 64, 8),
    ((33, 0, 9), 8, 1, 128, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"lens{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-b{c[4]}")
def test_paged_attention(device: str, dtype: str, case: tuple) -> None:
    seed = 1000 + ATTENTION_CASES.index(case) * 10 + DTYPES.index(dtype)
    print(f"seed={seed}")
    lens, heads, kv_heads, head_size, block_size = case
    args = paged_attention_inputs(np.random.default_rng(seed), seq_lens=lens, num_heads=heads,
                                  num_kv_heads=kv_heads, head_size=head_size, block_size=block_size, dtype=dtype)
    expected = OPS["paged_attention"].reference(args)
    t = {name: tensor(value, device) for name, value in args.items() if name != "scale"}
    assert t["query"].dtype == TORCH_DTYPES[dtype]
    positional = (t["query"], t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"], args["scale"])

    out = torch.ops.hal.paged_attention(*positional)  # poisoned caches: unread slots are NaN
    assert out.dtype == TORCH_DTYPES[dtype] and out.device.type == device
    assert_close(host(out), expected, kind="attention", dtype=dtype)
    into = torch.full_like(t["query"], float("nan"))
    assert hal_torch.paged_attention(*positional, out=into) is into
    assert_close(host(into), expected, kind="attention", dtype=dtype, what="out")

    bounded = hal_torch.paged_attention(*positional, max_seq_len=max(lens) + 3)  # a bound the caller knows
    assert_close(host(bounded), expected, kind="attention", dtype=dtype, what="max_seq_len")

    clean = tuple(_finite(a) if isinstance(a, torch.Tensor) else a for a in positional)
    torch.library.opcheck(torch.ops.hal.paged_attention.default, clean)
    torch.library.opcheck(torch.ops.hal.paged_attention.default, (*clean, max(lens)))
    torch.library.opcheck(torch.ops.hal.paged_attention_out.default, (*clean, torch.empty_like(clean[0])))
    torch.library.opcheck(torch.ops.hal.paged_attention_out.default,
                          (*clean, torch.empty_like(clean[0]), max(lens) + 1))


def test_paged_attention_errors_name_the_argument() -> None:
    args = paged_attention_inputs(np.random.default_rng(7), seq_lens=(4, 3), num_heads=4, num_kv_heads=2,
                                  head_size=64, block_size=8, dtype="fp32")
    q, kc, vc, bt, sl = (tensor(args[n]) for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))
    with pytest.raises(hal_core.ArgumentTypeError, match="block_tables"):
        hal_torch.paged_attention(q, kc, vc, bt.long(), sl, 0.125)
    with pytest.raises(hal_core.ArgumentError, match="seq_lens"):
        hal_torch.paged_attention(q, kc, vc, bt, sl + 1000, 0.125)
    with pytest.raises(hal_core.ArgumentError, match="max_seq_len = 3"):  # host lengths 4, 3: checked eagerly
        hal_torch.paged_attention(q, kc, vc, bt, sl, 0.125, max_seq_len=3)
    with pytest.raises(hal_core.ArgumentTypeError, match="max_seq_len"):
        hal_torch.paged_attention(q, kc, vc, bt, sl, 0.125, max_seq_len=0)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # rows apart, last dimension contiguous: accepted
    assert torch.equal(hal_torch.paged_attention(strided, kc, vc, bt, sl, 0.125),
                       hal_torch.paged_attention(q, kc, vc, bt, sl, 0.125))
    with pytest.raises(hal_core.ArgumentError, match="query"):
        hal_torch.paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, bt, sl, 0.125)
    with pytest.raises(Exception, match="argument 'out'"):  # the fake's check, as a trace sees it
        torch.compile(hal_torch.paged_attention, backend="eager", fullgraph=True)(
            q, kc, vc, bt, sl, 0.125, out=torch.empty(2, 4, 32))


# -- write_kv_cache ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_blocks,kv_heads,block_size,head_size", [(5, 3, 2, 8, 64), (12, 4, 1, 16, 128)])
def test_write_kv_cache(device: str, dtype: str, num_tokens: int, num_blocks: int, kv_heads: int,
                        block_size: int, head_size: int) -> None:
    seed = 2000 + 97 * num_tokens + DTYPES.index(dtype)
    print(f"seed={seed}")
    args = write_kv_cache_inputs(np.random.default_rng(seed), num_tokens=num_tokens, num_blocks=num_blocks,
                                 num_kv_heads=kv_heads, block_size=block_size, head_size=head_size, dtype=dtype)
    expected_k, expected_v = OPS["write_kv_cache"].reference(args)
    t = {name: tensor(value, device) for name, value in args.items()}
    k_ptr = t["key_cache"].data_ptr()
    assert hal_torch.write_kv_cache(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slot_mapping"]) is None
    assert t["key_cache"].data_ptr() == k_ptr
    assert_close(host(t["key_cache"]), expected_k, kind="copy", dtype=dtype, what="key_cache")
    assert_close(host(t["value_cache"]), expected_v, kind="copy", dtype=dtype, what="value_cache")

    clean = tuple(_finite(t[n]) for n in ("key", "value", "key_cache", "value_cache", "slot_mapping"))
    torch.library.opcheck(torch.ops.hal.write_kv_cache.default, clean)


def test_write_kv_cache_rejects_a_slot_beyond_the_cache_before_writing() -> None:
    args = write_kv_cache_inputs(np.random.default_rng(3), num_tokens=4, num_blocks=2, num_kv_heads=1,
                                 block_size=8, head_size=64, dtype="fp32")
    t = {name: tensor(value) for name, value in args.items()}
    before = t["key_cache"].clone()
    slots = torch.tensor([0, 1, 2, 16])
    with pytest.raises(hal_core.ArgumentError, match="slot_mapping"):
        hal_torch.write_kv_cache(t["key"], t["value"], t["key_cache"], t["value_cache"], slots)
    assert torch.equal(torch.nan_to_num(before), torch.nan_to_num(t["key_cache"]))


def test_repeated_host_calls_keep_their_signature_and_still_check_values() -> None:
    """The CPU operators run a kept signature's plan (an op bound with nothing fixed): new values give new
    results, a value the signature cannot vouch for (a slot beyond the cache) is still refused before any write."""
    hal_torch_ops._HOST_UNBOUND.clear()  # the signatures of earlier tests' calls
    rng = np.random.default_rng(4)
    seeds = [int(s) for s in rng.integers(0, 2**31, 3)]
    print(f"seeds={seeds}")
    for seed in seeds:  # one signature: the second and third calls take the kept one
        args = write_kv_cache_inputs(np.random.default_rng(seed), num_tokens=4, num_blocks=2, num_kv_heads=1,
                                     block_size=8, head_size=64, dtype="fp32")
        expected_k, expected_v = OPS["write_kv_cache"].reference(args)
        t = {name: tensor(value) for name, value in args.items()}
        hal_torch.write_kv_cache(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slot_mapping"])
        assert_close(host(t["key_cache"]), expected_k, kind="copy", dtype="fp32", what="key_cache")
        assert_close(host(t["value_cache"]), expected_v, kind="copy", dtype="fp32", what="value_cache")
    backend = hal_core.get_backend("cpu")
    bound = hal_torch_ops._HOST_UNBOUND[("write_kv_cache", id(backend))][1]
    assert bound.signature_count() == 1  # the three calls shared one kept signature
    before = t["key_cache"].clone()
    with pytest.raises(hal_core.ArgumentError, match="slot_mapping"):
        hal_torch.write_kv_cache(t["key"], t["value"], t["key_cache"], t["value_cache"],
                                 torch.tensor([0, 1, 2, 16], dtype=t["slot_mapping"].dtype))  # the same signature
    assert bound.signature_count() == 1
    assert torch.equal(torch.nan_to_num(before), torch.nan_to_num(t["key_cache"]))


# -- quantized_gemm -----------------------------------------------------------------

GEMM_CASES = [  # m, k, n, bits, group_size, symmetric, act_order
    (3, 128, 48, 4, 32, True, False),
    (5, 128, 40, 4, 64, False, True),
    (2, 64, 24, 8, 32, False, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: f"m{c[0]}-k{c[1]}-n{c[2]}-int{c[3]}-g{c[4]}")
def test_quantized_gemm(device: str, dtype: str, case: tuple) -> None:
    seed = 3000 + GEMM_CASES.index(case) * 10 + DTYPES.index(dtype)
    print(f"seed={seed}")
    m, k, n, bits, group_size, symmetric, act_order = case
    args = quantized_gemm_inputs(np.random.default_rng(seed), m=m, k=k, n=n, bits=bits, group_size=group_size,
                                 symmetric=symmetric, dtype=dtype, act_order=act_order)
    expected = OPS["quantized_gemm"].reference(args)
    weight = hal_torch.weight_to_tensors(args["qweight"], device=device)
    assert set(weight) == {"qweight", "scales"} | ({"zeros"} if not symmetric else set()) | (
        {"g_idx"} if act_order else set())
    x = tensor(args["x"], device)
    y = hal_torch.quantized_gemm(x, weight, bits)
    assert y.shape == (m, n) and y.dtype == TORCH_DTYPES[dtype]
    assert_close(host(y), expected, kind="gemm", dtype=dtype)

    positional = (x, weight["qweight"], weight["scales"], weight.get("zeros"), weight.get("g_idx"), bits, group_size)
    torch.library.opcheck(torch.ops.hal.quantized_gemm.default, positional)
    # with x requiring grad: the registered autograd formula, traced by AOTAutograd too
    torch.library.opcheck(torch.ops.hal.quantized_gemm.default, (x.detach().requires_grad_(), *positional[1:]))


def test_weight_round_trip_is_a_view() -> None:
    args = quantized_gemm_inputs(np.random.default_rng(11), m=1, k=64, n=16, bits=4, group_size=32,
                                 symmetric=False, dtype="fp32", act_order=True)
    qw = args["qweight"]
    tensors = hal_torch.weight_to_tensors(qw)
    assert tensors["qweight"].dtype == torch.int32
    assert tensors["qweight"].data_ptr() == qw.qweight.ctypes.data  # no copy on the host
    back = hal_torch.weight_from_tensors(tensors, bits=4)
    assert back == qw and back.group_size == 32 and back.shape == (64, 16)
    with pytest.raises(ValueError, match="scales"):
        hal_torch.weight_from_tensors({"qweight": tensors["qweight"]}, bits=4)
    with pytest.raises(ValueError, match="bits"):
        hal_torch.weight_from_tensors(tensors, bits=3)


@pytest.mark.parametrize("shape", [(2, 32), (0, 65), (0, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantized_gemm_shape_mismatch_is_named_in_eager_and_in_a_trace(shape: tuple) -> None:
    """x's K differs from the weight's (with rows or none): ArgumentError naming 'x', eager and traced."""
    args = quantized_gemm_inputs(np.random.default_rng(5), m=2, k=64, n=16, bits=4, group_size=32,
                                 symmetric=True, dtype="fp32")
    weight = hal_torch.weight_to_tensors(args["qweight"])
    x = torch.ones(shape)
    with pytest.raises(hal_core.ArgumentError, match="'x'"):
        hal_torch.quantized_gemm(x, weight, 4)
    with pytest.raises(Exception, match="argument 'x'"):
        torch.compile(hal_torch.quantized_gemm, backend="eager", fullgraph=True)(x, weight, 4)


def test_tensors_on_two_devices_are_named_not_given_an_uninitialised_result() -> None:
    """A host x with a weight on meta (or the reverse) goes to the meta kernel: ArgumentError naming the tensor."""
    args = quantized_gemm_inputs(np.random.default_rng(6), m=2, k=64, n=16, bits=4, group_size=32,
                                 symmetric=False, dtype="fp32")
    weight = hal_torch.weight_to_tensors(args["qweight"])
    on_meta = {name: t.to("meta") for name, t in weight.items()}
    x = tensor(args["x"])
    with pytest.raises(hal_core.ArgumentError, match=r"argument 'qweight': is on meta, argument 'x' on cpu"):
        hal_torch.quantized_gemm(x, on_meta, 4)
    with pytest.raises(hal_core.ArgumentError, match=r"argument 'qweight': is on cpu, argument 'x' on meta"):
        hal_torch.quantized_gemm(x.to("meta"), weight, 4)
    assert hal_torch.quantized_gemm(x.to("meta"), on_meta, 4).shape == (2, 16)  # all on meta: shapes only


# -- routing --------------------------------------------------------------------------


def test_host_tensors_run_on_the_host_backend() -> None:
    backend = hal_torch.backend_for(torch.ones(1))
    assert backend.owns(np.empty(0))


def test_memory_no_backend_owns_is_an_error() -> None:
    with pytest.raises(hal_core.ArgumentError, match="meta"):
        hal_torch.backend_for(torch.empty(1, device="meta"))


def test_host_weight_is_built_once_per_set_of_tensors_and_follows_replaced_tensors() -> None:
    """torch.ops.hal on CPU tensors checks and views a weight once; new tensors (or a freed one) are seen."""
    import gc

    from hal_core.quant import quantize
    from hal_core.torch import _weights, weight_to_tensors
    from hal_core.torch._weights import host_weight

    seed = int(np.random.SeedSequence().entropy % (2**32))  # type: ignore[operator]
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    w = quantize(rng.standard_normal((64, 24)).astype(np.float32), bits=4, group_size=32)
    t = weight_to_tensors(w)
    first = host_weight(t["qweight"], t["scales"], t.get("zeros"), None, 4, 32)
    assert host_weight(t["qweight"], t["scales"], t.get("zeros"), None, 4, 32) is first
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    expected = x.double().numpy() @ w.dequantize()
    got = torch.ops.hal.quantized_gemm(x, t["qweight"], t["scales"], t.get("zeros"), None, 4, 32)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4)
    # a new scales tensor (another weight's) is a new entry, with its own values
    w2 = quantize(rng.standard_normal((64, 24)).astype(np.float32), bits=4, group_size=32)
    t2 = weight_to_tensors(w2)
    again = host_weight(t["qweight"], t2["scales"], t.get("zeros"), None, 4, 32)
    assert again is not first and np.array_equal(again.scales, t2["scales"].numpy())
    # freeing the packed tensor drops its entry
    key = id(t["qweight"])
    assert key in _weights._HOST_WEIGHTS
    del t, first, again
    gc.collect()
    assert key not in _weights._HOST_WEIGHTS


def test_host_weight_keeps_the_weights_checks() -> None:
    from hal_core.torch._weights import host_weight

    qweight = torch.zeros((8, 16), dtype=torch.int32)
    with pytest.raises(ValueError, match="scales"):
        host_weight(qweight, torch.ones((3, 16)), None, None, 4, 32)


def test_routing_never_takes_a_freed_runtimes_entry() -> None:
    """A cached choice whose runtime was freed is not used, even when a new runtime reuses its id."""
    import weakref

    from hal_core._runtime import current
    from hal_core.torch import _routing

    x = torch.zeros(2)
    right = _routing.backend_for(x)

    class Gone:
        pass

    dead = weakref.ref(Gone())  # a reference whose object is already freed
    stale = object()
    runtime = current()
    key = (id(runtime), hal_core._env.backend_override(), "cpu", 0)
    _routing._chosen[key] = (dead, stale)  # type: ignore[assignment]
    try:
        assert _routing.backend_for(x) is right
    finally:
        _routing._chosen.pop(key, None)
