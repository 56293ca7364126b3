"""The CUDA op implementations end to end on the host, over numpy emulations of the kernels.

``kernel_emulator.NumpyCupy`` replaces CuPy (device arrays are an ndarray
subclass; kernels are numpy code written from the kernels README). This
checks the host side without a GPU: argument lists, workspaces, the
single/split-KV and fused/split-K/dequantise flows, bf16 storage, the
offload round trip. The kernels themselves are checked on a GPU by
test_gpu_ops.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import fakecupy
import kernel_emulator as emu
import numpy as np
import pytest
from kernel_emulator import NP, attention_inputs, host, rel_err, to_dev

import hal_core
from hal_core.ops import OPS, OpCall
from hal_core.quant import quantize

TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.5e-2}


@pytest.fixture(params=["H200", "MI300X"], ids=["warp32", "wave64"])
def backend(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """A stand-in GPU backend on an H200 (warp 32) or MI300X (wave 64) whose launcher compiles into the emulator."""
    from hal_cupy import _arrays, _cupy, _index_errors, _launcher, _memory, _stream
    from hal_cupy._launcher import CupyLauncher
    from hal_cupy.ops import _common, _gated_activation, _paged_attention, _quantized_gemm, _rms_norm, _write_kv_cache

    fake = emu.NumpyCupy()
    for module in (_arrays, _cupy, _index_errors, _launcher, _memory, _stream, _common, _paged_attention,
                   _quantized_gemm, _write_kv_cache, _rms_norm, _gated_activation):
        monkeypatch.setattr(module, "cupy", lambda: fake)
    from hal_cupy.ops import _rotary_embedding

    monkeypatch.setattr(_rotary_embedding, "cupy", lambda: fake)
    _index_errors.forget_flags()
    request.addfinalizer(_index_errors.forget_flags)
    caps = hal_core.load_profile(request.param)
    # The H200's platform provides the warp matrix instructions (level 90), the MI300X's none.
    platform = fakecupy.FakePlatform(90 if caps.simd_width == 32 else 0)
    device = SimpleNamespace(capabilities=caps, launcher=CupyLauncher(0, caps), platform=platform)
    emu.LAUNCHED.clear()
    return SimpleNamespace(name="cuda", device=lambda index: device, platform=platform)


def run(op: str, backend: Any, host_args: dict[str, Any], *, host_arrays: bool = False) -> Any:
    from hal_cupy.ops import OPS as CUDA_OPS

    impl = next(o for o in CUDA_OPS if o.op == op)
    args = dict(host_args) if host_arrays else OPS[op].map_arrays(host_args, to_dev)
    OPS[op].validate(args, host)
    args.pop("out", None)  # implementations never see the caller's out: the front door writes it
    call = OpCall(spec=OPS[op], args=args, backend=backend, host_arrays=host_arrays)
    assert impl.supports(call) is True
    return impl(call), args


def attention(rng: np.random.Generator, dtype: str, seq_lens: list[int], **shape: int) -> dict[str, Any]:
    return {**attention_inputs(rng, dtype, seq_lens, **shape), "out": None}


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize(("seq_lens", "kernels"), [
    ([0, 37, 300], ["hal_paged_attention"]),
    ([1, 700, 2100], ["hal_paged_attention_split", "hal_paged_attention_reduce"]),
], ids=["single", "split"])
def test_paged_attention_simt(backend: Any, rng: np.random.Generator, dtype: str, seq_lens: list[int],
                              kernels: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The SIMT kernels: fp32 always, fp16/bf16 with HAL_CUDA_TENSOR_CORES=0 (or a group below 4)."""
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", "0")
    args = attention(rng, dtype, seq_lens)
    out, _ = run("paged_attention", backend, args)
    assert kernels == emu.LAUNCHED
    assert rel_err(out, OPS["paged_attention"].reference(args)) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize(("seq_lens", "kernels"), [
    ([0, 37, 300] * 40, ["hal_paged_attention_tc"]),  # 120 sequences x 2 KV heads fill the device: no split
    ([1, 700, 2100], ["hal_paged_attention_tc", "hal_paged_attention_reduce"]),
], ids=["single", "split"])
def test_paged_attention_tensor_cores(backend: Any, rng: np.random.Generator, dtype: str, seq_lens: list[int],
                                      kernels: list[str]) -> None:
    """GQA group 4 in fp16/bf16 at level 90: the tensor-core kernel, split-KV merged by the SIMT reduce; a
    platform without warp matrix instructions runs the SIMT kernels."""
    args = attention(rng, dtype, seq_lens)
    out, _ = run("paged_attention", backend, args)
    if backend.platform.mma_level:
        assert kernels == emu.LAUNCHED
    else:
        assert emu.LAUNCHED and not any(name.endswith("_tc") for name in emu.LAUNCHED)
    assert rel_err(out, OPS["paged_attention"].reference(args)) < TOL[dtype]


def test_paged_attention_small_group_and_fp32_stay_simt(backend: Any, rng: np.random.Generator) -> None:
    """A group of 2 and fp32 caches keep the SIMT kernels on a tensor-core GPU."""
    for dtype, heads in (("fp16", 4), ("fp32", 8)):
        emu.LAUNCHED.clear()
        args = attention(rng, dtype, [50, 9], heads=heads, kv_heads=2)
        out, _ = run("paged_attention", backend, args)
        assert emu.LAUNCHED == ["hal_paged_attention"]
        assert rel_err(out, OPS["paged_attention"].reference(args)) < TOL[dtype]


def test_paged_attention_gqa_tiles(backend: Any, rng: np.random.Generator) -> None:
    """A group of 16 query heads per KV head (two GQA tiles)."""
    args = attention(rng, "fp16", [100, 513], heads=32, kv_heads=2, head_size=128)
    result, _ = run("paged_attention", backend, args)
    assert rel_err(result, OPS["paged_attention"].reference(args)) < TOL["fp16"]


def varlen(rng: np.random.Generator, dtype: str, seq_lens: list[int], query_lens: list[int] | None,
           **variants: Any) -> dict[str, Any]:
    """Prefill/mixed (or decode, ``query_lens`` None) arguments from hal-core's builder, with variants."""
    from hal_core.ops.paged_attention import paged_attention_inputs

    args = paged_attention_inputs(rng, seq_lens=seq_lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                                  dtype=dtype, query_lens=query_lens)
    if variants.pop("strided", False):  # K and V halves of one [num_blocks, 2, ...] buffer
        both = np.stack([args["key_cache"], args["value_cache"]], axis=1)
        args["key_cache"], args["value_cache"] = both[:, 0], both[:, 1]
    if variants.pop("sinks", False):
        args["sinks"] = rng.uniform(-1, 2, 8).astype(np.float32)
    if variants.pop("alibi", False):
        args["alibi_slopes"] = (2.0 ** -rng.uniform(1, 8, 8)).astype(np.float32)
    return {**args, **variants, "out": None}


@pytest.mark.parametrize(("seq_lens", "query_lens", "variants", "kernels"), [
    ([40, 9, 300], [40, 1, 6], {}, ["hal_paged_attention"]),
    ([40, 9, 300], [40, 1, 6], {"window": 32, "softcap": 20.0, "sinks": True, "alibi": True, "strided": True},
     ["hal_paged_attention"]),
    ([1, 700, 2100], [1, 3, 1], {"sinks": True, "window": 600}, ["hal_paged_attention_split",
                                                                 "hal_paged_attention_reduce"]),
    ([0, 700, 2100], None, {"softcap": 10.0, "alibi": True, "strided": True}, ["hal_paged_attention_split",
                                                                              "hal_paged_attention_reduce"]),
    ([0, 37, 300], None, {"sinks": True}, ["hal_paged_attention"]),
], ids=["prefill-mixed", "prefill-variants", "mixed-split", "decode-variants-split", "decode-sinks"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_paged_attention_varlen(backend: Any, rng: np.random.Generator, dtype: str, seq_lens: list[int],
                                query_lens: list[int] | None, variants: dict[str, Any], kernels: list[str]) -> None:
    """Prefill rows and the variants: the tensor-core kernel for bf16 where the platform has the warp matrix
    instructions (prefill rows fill its 16 rows whatever the group; decode needs a group of 4, as here), the
    SIMT kernels otherwise; both match the float64 reference."""
    args = varlen(rng, dtype, seq_lens, query_lens, **variants)
    out, _ = run("paged_attention", backend, args)
    if backend.platform.mma_level and dtype == "bf16":
        assert emu.LAUNCHED[0] == "hal_paged_attention_tc"
        assert emu.LAUNCHED[1:] in ([], ["hal_paged_attention_reduce"])
    else:
        assert kernels == emu.LAUNCHED
    assert rel_err(out, OPS["paged_attention"].reference(args)) < TOL[dtype]


def test_paged_attention_declares_every_variant(backend: Any) -> None:
    """The coverage hal-cupy declares: every variant, the kernels' head and block sizes."""
    from hal_cupy.ops import _paged_attention_rules as rules
    from hal_cupy.ops import register_ops

    from hal_core.ops import OpRegistry

    registry = OpRegistry()
    register_ops(registry, "cuda")
    coverage = registry.coverage("paged_attention")
    assert set(coverage.variants) == {"prefill", "window", "softcap", "sinks", "alibi", "strided_cache"}
    assert set(coverage.head_sizes) == set(rules.PA_HEAD_SIZES)
    assert set(coverage.block_sizes) == set(rules.PA_BLOCK_SIZES)


def test_paged_attention_unequal_strides_keep_simt(backend: Any, rng: np.random.Generator) -> None:
    """Caches of different strides (each its own padded buffer) run on the SIMT kernels even where tensor cores
    serve the call otherwise; the result matches the float64 reference."""
    args = varlen(rng, "bf16", [40, 9], [40, 1])
    key = np.zeros((*args["key_cache"].shape[:3], 72), args["key_cache"].dtype)  # 144-byte rows
    key[..., :64] = args["key_cache"]
    args["key_cache"] = key[..., :64]
    out, _ = run("paged_attention", backend, args)
    assert emu.LAUNCHED == ["hal_paged_attention"]
    assert rel_err(out, OPS["paged_attention"].reference(args)) < TOL["bf16"]


def test_paged_attention_misaligned_strides_fall_back(backend: Any, rng: np.random.Generator) -> None:
    """A cache view whose rows do not start on 16 bytes is refused with the reason (the CPU path runs it)."""
    from hal_cupy.ops import OPS as CUDA_OPS

    args = varlen(rng, "fp16", [20, 9], [20, 1])
    padded = np.zeros((*args["key_cache"].shape[:3], 68), np.float16)  # 136-byte rows
    padded[..., :64] = args["key_cache"]
    args["key_cache"] = padded[..., :64]
    dev = OPS["paged_attention"].map_arrays(args, to_dev)
    OPS["paged_attention"].validate(dev, host)
    dev.pop("out", None)
    impl = next(o for o in CUDA_OPS if o.op == "paged_attention")
    reason = impl.supports(OpCall(spec=OPS["paged_attention"], args=dev, backend=backend))
    assert isinstance(reason, str) and "key_cache" in reason and "16 bytes" in reason


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=["slot32", "slot64"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_write_kv_cache(backend: Any, rng: np.random.Generator, dtype: str, slot_dtype: Any) -> None:
    key = rng.standard_normal((5, 2, 64)).astype(NP[dtype])
    cache = rng.standard_normal((3, 2, 16, 64)).astype(NP[dtype])
    slots = np.array([3, -1, 40, 17, 0], slot_dtype)
    args = dict(key=key, value=key * 2, key_cache=cache, value_cache=cache.copy(), slot_mapping=slots)
    result, dev_args = run("write_kv_cache", backend, args)
    want_k, want_v = OPS["write_kv_cache"].reference(args)
    assert result is None
    np.testing.assert_array_equal(host(dev_args["key_cache"]).astype(np.float64), want_k)
    np.testing.assert_array_equal(host(dev_args["value_cache"]).astype(np.float64), want_v)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_write_kv_cache_strided_key_value(backend: Any, rng: np.random.Generator, dtype: str) -> None:
    """Key/value views of a fused QKV array ([T, 3, H, D][:, 1] and [:, 2]) are written like dense rows."""
    qkv = rng.standard_normal((5, 3, 2, 64)).astype(NP[dtype])
    cache = rng.standard_normal((3, 2, 16, 64)).astype(NP[dtype])
    slots = np.array([3, -1, 40, 17, 0], np.int64)
    dense = dict(key=qkv[:, 1].copy(), value=qkv[:, 2].copy(), key_cache=cache, value_cache=cache.copy(),
                 slot_mapping=slots)
    dev_qkv = to_dev(qkv)
    args = OPS["write_kv_cache"].map_arrays(dict(dense, key=None, value=None), to_dev)
    args.update(key=dev_qkv[:, 1], value=dev_qkv[:, 2])
    OPS["write_kv_cache"].validate(args, host)
    call = OpCall(spec=OPS["write_kv_cache"], args=args, backend=backend, host_arrays=False)
    from hal_cupy.ops import OPS as CUDA_OPS

    impl = next(o for o in CUDA_OPS if o.op == "write_kv_cache")
    assert impl.supports(call) is True
    impl(call)
    want_k, want_v = OPS["write_kv_cache"].reference(dense)
    np.testing.assert_array_equal(host(args["key_cache"]).astype(np.float64), want_k)
    np.testing.assert_array_equal(host(args["value_cache"]).astype(np.float64), want_v)


@pytest.mark.parametrize("m", [1, 5, 17, 40, 130], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_quantized_gemm(backend: Any, rng: np.random.Generator, bits: int, dtype: str, m: int) -> None:
    """H200 (level 90): tensor cores for W8A8 always (int8 MMA, every dtype) and W4A16 in fp16/bf16 to M = 128;
    else SIMT kernels, then K-slabs."""
    qw = quantize(rng.standard_normal((1024, 256)).astype(np.float32) * 0.1, bits=bits, group_size=64,
                  symmetric=False)
    x = rng.standard_normal((m, 1024)).astype(NP[dtype])
    args = dict(x=x, qweight=qw, out=None)
    out, _ = run("quantized_gemm", backend, args)
    names = set(emu.LAUNCHED)
    tc = backend.platform.mma_level > 0 and (bits == 8 or (dtype != "fp32" and m <= 128))
    kind = f"hal_w{bits}a{'16' if bits == 4 else '8'}"
    assert (f"{kind}_gemm_tc" in names) == tc
    assert (f"{kind}_gemm" in names) == (not tc and m <= 32)
    slabs = not tc and m > 32
    assert bool(emu.GEMM_CALLS) == slabs and ("hal_w4a16_dequant" in names or "hal_w8_dequant" in names) == slabs
    assert (bits == 8) == ("hal_w8a8_quantize_rows" in names)
    if f"{kind}_gemm" in names:  # SIMT: a K split's partials are summed in split order, never atomically
        from hal_cupy.ops import _quantized_gemm_rules as qg_rules

        caps = backend.device(0).capabilities
        _, ksplit, _ = qg_rules.quant_gemm_launch(bits, m, 256, 1024, 64, caps.compute_units, caps.simd_width)
        assert ("hal_f32_splits_to_dtype" in names) == (ksplit > 1)
    tol = TOL[dtype] if dtype != "fp32" else 1e-4
    assert rel_err(out, OPS["quantized_gemm"].reference(args)) < tol


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_quantized_gemm_large_m_slabs(backend: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                      bits: int, dtype: str) -> None:
    """Without tensor cores (HAL_CUDA_TENSOR_CORES=0), large M: K-slabs of the weight dequantised into one small
    workspace, accumulated by cuBLAS in the activations' dtype (bf16 stays bf16) with beta = 1 after the first."""
    from hal_cupy.ops import _quantized_gemm as qg

    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", "0")
    monkeypatch.setattr(qg, "QGEMM_SLAB_BYTES", 256 * 2 * 128)  # 128-row slabs: 8 of them for K = 1024
    qw = quantize(rng.standard_normal((1024, 256)).astype(np.float32) * 0.1, bits=bits, group_size=64,
                  symmetric=bits == 8)
    x = rng.standard_normal((40, 1024)).astype(NP[dtype])
    args = dict(x=x, qweight=qw, out=None)
    out, _ = run("quantized_gemm", backend, args)
    calls = emu.GEMM_CALLS
    assert len(calls) == 8 and all(c["k"] == 128 for c in calls)
    assert [c["beta"] for c in calls] == [0.0] + [1.0] * 7
    assert {c["atype"] for c in calls} == {14 if dtype == "bf16" else 2} and {c["ctype"] for c in calls} == {0}
    assert "hal_f32_to_dtype" in emu.LAUNCHED  # the fp32 accumulator, cast once
    assert rel_err(out, OPS["quantized_gemm"].reference(args)) < TOL[dtype]


def test_tensor_core_weight_is_packed_once(backend: Any, rng: np.random.Generator) -> None:
    """The tensor-core layout is built on first use of a weight and reused from the cache after (never without
    the warp matrix instructions)."""
    from hal_cupy.ops import OPS as CUDA_OPS
    from hal_cupy.ops import _quantized_gemm as qg

    qw = quantize(rng.standard_normal((256, 128)).astype(np.float32), group_size=32)
    x = rng.standard_normal((3, 256)).astype(np.float16)
    args = OPS["quantized_gemm"].map_arrays(dict(x=x, qweight=qw, out=None), to_dev)
    impl = next(o for o in CUDA_OPS if o.op == "quantized_gemm")
    calls: list[int] = []
    original = qg.pack_weight
    try:
        qg.pack_weight = lambda *a: calls.append(1) or original(*a)  # type: ignore[assignment]
        for _ in range(3):
            out = impl(OpCall(spec=OPS["quantized_gemm"], args=args, backend=backend, host_arrays=False))
            assert rel_err(out, OPS["quantized_gemm"].reference(dict(x=x, qweight=qw))) < TOL["fp16"]
    finally:
        qg.pack_weight = original
    assert calls == ([1] if backend.platform.mma_level else [])


def test_offload_round_trip(backend: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host inputs are copied in, computed on the 'device' and the result copied back to a host array."""
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "0")
    qw = quantize(rng.standard_normal((256, 128)).astype(np.float32))
    x = rng.standard_normal((3, 256)).astype(np.float16)
    result, _ = run("quantized_gemm", backend, dict(x=x, qweight=qw), host_arrays=True)
    assert type(result) is np.ndarray
    assert rel_err(result, OPS["quantized_gemm"].reference(dict(x=x, qweight=qw))) < TOL["fp16"]


def test_offload_in_place(backend: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_kv_cache on host caches (with the threshold at 0) writes the host caches back."""
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "0")
    key = rng.standard_normal((2, 1, 64)).astype(np.float16)
    cache = np.zeros((1, 1, 16, 64), np.float16)
    vcache = np.zeros_like(cache)
    run("write_kv_cache", backend, dict(key=key, value=key, key_cache=cache, value_cache=vcache,
                                         slot_mapping=np.array([4, 9], np.int64)), host_arrays=True)
    np.testing.assert_array_equal(cache[0, 0, 4], key[0, 0])
    np.testing.assert_array_equal(vcache[0, 0, 9], key[1, 0])


@pytest.mark.parametrize("m", [3, 40], ids=["fused", "dequant"])
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_quantized_gemm_k0_is_zeros_without_launch(backend: Any, bits: int, m: int) -> None:
    """K = 0 (an empty sum): zeros of [M, N], and no kernel launched."""
    qw = quantize(np.zeros((0, 128), np.float32), bits=bits, group_size=64)
    result, _ = run("quantized_gemm", backend, dict(x=np.zeros((m, 0), np.float16), qweight=qw))
    assert emu.LAUNCHED == []
    np.testing.assert_array_equal(host(result), np.zeros((m, 128), np.float16))


def test_write_kv_cache_refuses_an_odd_address(backend: Any, rng: np.random.Generator) -> None:
    """The kernel copies units of 2 bytes or more: an fp16 key at an odd address goes to the CPU path."""
    from hal_cupy.ops import OPS as CUDA_OPS

    key = rng.standard_normal((2, 1, 64)).astype(np.float16)
    raw = np.zeros(key.nbytes + 1, np.uint8).view(emu.DevArray)
    odd = raw[1:].view(np.float16).reshape(key.shape)
    odd[...] = key
    cache = emu.dev(np.zeros((1, 1, 16, 64), np.float16))
    args = dict(key=odd, value=emu.dev(key), key_cache=cache, value_cache=emu.dev(np.zeros_like(cache)),
                slot_mapping=emu.dev(np.array([1, 2], np.int64)))
    call = OpCall(spec=OPS["write_kv_cache"], args=args, backend=backend, host_arrays=False)
    impl = next(o for o in CUDA_OPS if o.op == "write_kv_cache")
    assert impl.supports(call) == "argument 'key' is not 2-byte aligned (a sliced view?); pass a fresh array"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-add"])
def test_rms_norm(backend: Any, rng: np.random.Generator, dtype: str, residual: bool) -> None:
    """rms_norm's argument list and launch (one CTA per row) on strided rows; the residual is written back."""
    from hal_core.arrays import untag
    from hal_core.testing.inputs import rms_norm_inputs

    args = rms_norm_inputs(rng, num_tokens=4, hidden_size=96, dtype=dtype, residual=residual, row_stride=100)
    args["weight_offset"] = 1.0
    expected, expected_residual = OPS["rms_norm"].reference(args)
    device_args = OPS["rms_norm"].map_arrays(args, to_dev)
    assert not untag(device_args["x"]).flags.c_contiguous  # the strided view goes in as a view
    result, device_args = _run_args("rms_norm", backend, device_args)
    assert emu.LAUNCHED == ["hal_rms_norm"]
    assert rel_err(result, expected) < TOL[dtype]
    if residual:
        np.testing.assert_array_equal(host(device_args["residual"]).astype(np.float64), expected_residual)


@pytest.mark.parametrize("activation", [None, "silu", "gelu", "gelu_tanh"])
def test_gated_activation(backend: Any, rng: np.random.Generator, activation: str | None) -> None:
    """gated_activation on the halves of a fused gate-up device array: no copy, grid of column blocks."""
    from hal_core.testing.inputs import gated_activation_inputs

    args = gated_activation_inputs(rng, num_tokens=3, intermediate_size=2100, dtype="bf16", activation=activation)
    both = to_dev(np.concatenate([args["gate"], args["up"]], axis=1))
    device_args = {"gate": both[:, :2100], "up": both[:, 2100:], "activation": activation}
    result, _ = _run_args("gated_activation", backend, device_args)
    assert emu.LAUNCHED == ["hal_gated_activation"]
    assert rel_err(result, OPS["gated_activation"].reference(args)) < TOL["bf16"]


def _run_args(op: str, backend: Any, device_args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Run the GPU implementation of ``op`` on device arguments as given (views stay views)."""
    from hal_cupy.ops import OPS as CUDA_OPS

    impl = next(o for o in CUDA_OPS if o.op == op)
    OPS[op].validate(device_args, host)
    call = OpCall(spec=OPS[op], args=device_args, backend=backend, host_arrays=False)
    assert impl.supports(call) is True
    emu.LAUNCHED.clear()
    return impl(call), device_args

