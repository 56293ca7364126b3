"""Launch plans, kernel choice and op ``supports`` rules, checked against saved GPU profiles (no GPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gpu_profiles import GPU_PROFILES, PROFILE_IDS
from hal_cupy import all_specializations
from hal_cupy._specialization import DTYPE_CODES, Launch
from hal_cupy.ops import _paged_attention as pa
from hal_cupy.ops import _paged_attention_rules as pa_rules
from hal_cupy.ops import _quantized_gemm as qg
from hal_cupy.ops import _quantized_gemm_rules as qg_rules
from hal_cupy.ops import _write_kv_cache as kv
from hal_cupy.ops import _write_kv_cache_rules as kv_rules
from hal_cupy.ops._common import GpuOp

import hal_core
from hal_core import LaunchConfig
from hal_core.ops import OPS, OpCall
from hal_core.quant import quantize


@pytest.fixture(params=GPU_PROFILES, ids=PROFILE_IDS)
def caps(request: pytest.FixtureRequest) -> hal_core.DeviceCapabilities:
    return hal_core.load_profile(request.param)


def _config(plan: Launch) -> LaunchConfig:
    return LaunchConfig(grid=plan.grid, block=plan.block, shared_mem=plan.shared_mem)


@pytest.mark.parametrize(("num_seqs", "num_heads", "num_kv_heads", "max_seq_len"), [
    (1, 32, 8, 32768), (32, 32, 8, 4096), (256, 64, 8, 2048), (4, 28, 4, 100), (1, 16, 1, 200_000),
], ids=["1x32k", "32x4k", "256x2k-gqa8", "short", "mqa-200k"])
def test_paged_attention_plans_fit(caps: Any, num_seqs: int, num_heads: int, num_kv_heads: int,
                                   max_seq_len: int) -> None:
    """Every launch of the chosen variant passes the device's limits; static shared memory fits 48 KiB."""
    variant = pa_rules.choose_paged_attention_variant(num_seqs, num_kv_heads, max_seq_len, caps.compute_units,
                                                      num_heads=num_heads)
    for plan in pa_rules.paged_attention_launches(variant, num_seqs, num_heads, num_kv_heads, max_seq_len):
        _config(plan).validate(caps)
    group = num_heads // num_kv_heads
    for head_size in pa_rules.PA_HEAD_SIZES:
        for dtype in DTYPE_CODES:
            shared = pa_rules.paged_attention_shared_bytes(dtype, head_size, pa_rules.paged_attention_gqa_tile(group),
                                                           caps.simd_width)
            assert shared <= caps.shared_mem_per_block


def test_split_rule_on_h200() -> None:
    """The benchmark shapes on an H200 (132 SMs): both long-context cases use split-KV, short ones single."""
    cus = hal_core.load_profile("H200").compute_units
    assert pa_rules.choose_paged_attention_variant(1, 8, 32768, cus, num_heads=32) == "split"
    assert pa_rules.choose_paged_attention_variant(32, 8, 4096, cus, num_heads=32) == "split"  # 256 CTAs < 2 x 132
    assert pa_rules.choose_paged_attention_variant(64, 8, 4096, cus, num_heads=32) == "single"
    assert pa_rules.choose_paged_attention_variant(32, 8, 512, cus, num_heads=32) == "single"


def test_split_rule_on_amd_profiles() -> None:
    """MI300X's 304 CUs want 608 CTAs before one pass pays; the 7900 XTX's 48 WGPs are busy with far fewer."""
    mi300 = hal_core.load_profile("MI300X").compute_units
    assert mi300 == 304
    assert pa_rules.choose_paged_attention_variant(64, 8, 4096, mi300, num_heads=32) == "split"  # 512 CTAs < 608
    assert pa_rules.choose_paged_attention_variant(128, 8, 4096, mi300, num_heads=32) == "single"
    rdna = hal_core.load_profile("RX 7900 XTX").compute_units
    assert pa_rules.choose_paged_attention_variant(32, 8, 4096, rdna, num_heads=32) == "single"


@pytest.mark.parametrize(("profile", "lanes"), [("MI300X", 64), ("MI250X", 64), ("RX 7900 XTX", 32), ("H100", 32)])
def test_specialisations_follow_the_simd_width(profile: str, lanes: int) -> None:
    """Kernels are specialised by the device's SIMD width; the GEMM block is four warps/wavefronts of it."""
    caps = hal_core.load_profile(profile)
    assert caps.simd_width == lanes
    for spec in all_specializations(caps.simd_width):
        assert ("HAL_WARP_SIZE", str(lanes)) in spec.defines
    plan, _, _ = qg_rules.quant_gemm_launch(4, 1, 4096, 4096, 128, caps.compute_units, caps.simd_width)
    assert plan.block == (4 * lanes, 1, 1) and plan.grid[0] == 4096 // (4 * lanes)
    with pytest.raises(ValueError, match="warp_size"):
        kv_rules.write_kv_cache_spec(True, 16)


@pytest.mark.parametrize(("num_seqs", "num_tokens", "max_query_len", "num_heads", "num_kv_heads", "max_seq_len"), [
    (1, 8192, 8192, 32, 8, 8192), (64, 2048, 512, 64, 8, 4096), (4, 4, 1, 28, 4, 32768), (3, 300, 256, 9, 3, 100_000),
    (256, 1024, 16, 32, 8, 2048),
], ids=["prompt-8k", "mixed-64", "decode-4", "gqa3-100k", "chunks-256"])
def test_varlen_plans_fit(caps: Any, num_seqs: int, num_tokens: int, max_query_len: int, num_heads: int,
                          num_kv_heads: int, max_seq_len: int) -> None:
    """Prefill and mixed grids pass the device's limits; a split's workspace stays within its bound and its reduce
    step has one CTA row per query row."""
    variant = pa_rules.choose_paged_attention_variant(num_seqs, num_kv_heads, max_seq_len, caps.compute_units,
                                                      num_heads=num_heads, max_query_len=max_query_len,
                                                      num_tokens=num_tokens, head_size=128)
    plans = pa_rules.paged_attention_launches(variant, num_seqs, num_heads, num_kv_heads, max_seq_len,
                                              max_query_len=max_query_len, num_tokens=num_tokens)
    for plan in plans:
        _config(plan).validate(caps)
    group = num_heads // num_kv_heads
    rows = pa_rules.paged_attention_rows(group, max_query_len)
    assert plans[0].grid[0] * rows >= num_kv_heads * max_query_len * group  # every row has a CTA
    assert plans[0].grid[0] == num_kv_heads * pa_rules.paged_attention_tiles(num_heads, num_kv_heads, max_query_len)
    if variant == "split":
        assert pa.split_workspace_bytes(num_tokens, num_heads, 128, max_seq_len) <= pa_rules.PA_SPLIT_WORKSPACE_BYTES
        assert plans[1].grid[:2] == (num_heads, num_tokens)


def test_varlen_rows_and_split_rule() -> None:
    """Decode keeps the GQA tile; prefill rows take 8 per CTA; a long prompt never splits (its workspace), a short
    chunk over a long context does."""
    assert [pa_rules.paged_attention_rows(g) for g in (1, 2, 3, 4, 6, 16)] == [1, 2, 4, 4, 8, 8]
    assert [pa_rules.paged_attention_rows(g, 2) for g in (1, 3, 16)] == [8, 8, 8]
    assert pa_rules.paged_attention_tiles(32, 8, 1) == 1 and pa_rules.paged_attention_tiles(48, 2, 1) == 3
    assert pa_rules.paged_attention_tiles(32, 8, 100) == 50 and pa_rules.paged_attention_tiles(9, 3, 5) == 2
    cus = hal_core.load_profile("H200").compute_units
    assert pa_rules.choose_paged_attention_variant(1, 8, 8192, cus, num_heads=32, max_query_len=8192,
                                                   num_tokens=8192, head_size=128) == "single"
    assert pa_rules.choose_paged_attention_variant(1, 8, 32768, cus, num_heads=32, max_query_len=16,
                                                   num_tokens=16, head_size=128) == "split"
    with pytest.raises(ValueError, match="max_query_len"):
        pa_rules.paged_attention_rows(4, 0)


def test_tc_varlen_partitions_and_grid() -> None:
    """The tensor-core kernel's grid counts 16-row tiles of new tokens x heads; a long prompt does not split
    (its workspace would pass the bound), a short chunk over a long context does; the reduce has a row per token."""
    occ = pa_rules.paged_attention_tc_ctas_per_cu(128)
    size, parts = pa_rules.paged_attention_tc_partitions(1, 32, 8, 8192, 128, 132, occ, max_query_len=8192,
                                                         num_tokens=8192)
    assert parts == 1 and size >= 8192
    size, parts = pa_rules.paged_attention_tc_partitions(1, 32, 8, 32768, 128, 132, occ, max_query_len=16,
                                                         num_tokens=16)
    assert parts > 1 and 4 * 16 * 32 * parts * 130 <= pa_rules.PA_SPLIT_WORKSPACE_BYTES
    plans = pa_rules.paged_attention_tc_launches(2, 32, 8, parts, 128, 132, max_query_len=16, num_tokens=17)
    assert plans[0].grid == (8 * 4, 2, parts)  # 16 tokens x 4 heads = 64 rows: 4 tiles per KV head
    assert plans[1].grid[:2] == (32, 17)
    assert pa_rules.paged_attention_tc_launches(3, 32, 8, 1)[0].grid == (8, 3, 1)  # decode: one tile of 4 heads


@pytest.mark.parametrize(("max_seq_len", "bound"), [(None, 4096), (900, 900), (4096, 4096), (10**6, 4096)])
def test_seq_len_bound_comes_from_the_host(max_seq_len: int | None, bound: int) -> None:
    """Launches are sized for min(max_seq_len, capacity) (capacity = 256 blocks of 16), never from seq_lens' values:
    the lengths here are device-like objects whose every read raises."""
    class Unreadable:
        shape = (2,)

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"seq_lens.{name} read: the launch must be sized on the host")

    args = {"block_tables": np.zeros((2, 256), np.int32), "key_cache": np.zeros((300, 1, 16, 64), np.float16),
            "seq_lens": Unreadable(), "max_seq_len": max_seq_len}
    call = OpCall(spec=OPS["paged_attention"], args=args, backend=None)  # type: ignore[arg-type]
    assert pa.seq_len_bound(call) == bound
    assert pa.split_workspace_bytes(32, 32, 128, 4096) == 4 * 32 * 32 * 8 * 130


@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (4096, 11008), (8192, 28672)], ids=["4k", "11k", "28k"])
@pytest.mark.parametrize("m", [1, 16, 32], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bits", [4, 8])
def test_quant_gemm_plans_fit(caps: Any, m: int, k: int, n: int, bits: int) -> None:
    """Small-M GEMM grids fit the device and cover every K group exactly once."""
    plan, ksplit, per_split = qg_rules.quant_gemm_launch(bits, m, n, k, 128, caps.compute_units, caps.simd_width)
    _config(plan).validate(caps)
    groups = k // 128
    assert (ksplit - 1) * per_split < groups <= ksplit * per_split
    assert plan.grid[0] * 4 * caps.simd_width >= n


def test_quant_gemm_plan_refuses_k0(caps: Any) -> None:
    """K = 0 has no K group to split (the op answers it with zeros before planning)."""
    with pytest.raises(ValueError, match="K > 0"):
        qg_rules.quant_gemm_launch(4, 1, 128, 0, 128, caps.compute_units, caps.simd_width)


def test_grid_stride_grids(caps: Any) -> None:
    """Grid-stride kernels: grid from SM count x resident blocks, never above the work."""
    blocks = max(1, caps.max_threads_per_cu // 256)
    assert hal_core.grid_for(caps, 10**9, 256, blocks_per_cu=blocks) == caps.compute_units * blocks
    assert hal_core.grid_for(caps, 300, 256) == 2


def test_small_m_threshold_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    """HAL_CUDA_SMALL_M_MAX moves the fused/dequantise boundary; the default is the catalogue's."""
    assert qg.small_m_threshold("cuda") == qg_rules.QGEMM_SMALL_M_MAX
    assert qg.uses_small_m(qg_rules.QGEMM_SMALL_M_MAX, "cuda")
    assert not qg.uses_small_m(qg_rules.QGEMM_SMALL_M_MAX + 1, "cuda")
    monkeypatch.setenv("HAL_CUDA_SMALL_M_MAX", "64")
    assert qg.uses_small_m(64, "cuda") and not qg.uses_small_m(65, "cuda")


# -- supports(): reasons that send a call to the CPU path --------------------------------------------


def _call(op: str, caps: Any, host: bool = True, **args: Any) -> OpCall:
    backend = SimpleNamespace(device=lambda index: SimpleNamespace(capabilities=caps), name="cuda")
    spec = OPS[op]
    spec.validate(args, np.asarray)
    return OpCall(spec=spec, args=args, backend=backend, host_arrays=host)


def _attention(num_seqs: int = 2, heads: int = 8, kv_heads: int = 2, head_size: int = 128, block: int = 16,
               dtype: Any = np.float16, tokens: int = 64) -> dict[str, Any]:
    blocks = -(-tokens // block)
    return dict(query=np.zeros((num_seqs, heads, head_size), dtype),
                key_cache=np.zeros((num_seqs * blocks, kv_heads, block, head_size), dtype),
                value_cache=np.zeros((num_seqs * blocks, kv_heads, block, head_size), dtype),
                block_tables=np.arange(num_seqs * blocks, dtype=np.int32).reshape(num_seqs, blocks),
                seq_lens=np.full(num_seqs, tokens, np.int32), scale=0.1, out=None)


@pytest.fixture
def offload_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "0")


@pytest.mark.usefixtures("offload_everything")
@pytest.mark.parametrize(("change", "reason"), [
    (dict(head_size=100), "head_size 100 has no GPU kernel"),
    (dict(head_size=48), "head_size 48"),
    (dict(block=24), "block_size 24"),
    (dict(block=1), "block_size 1"),
], ids=["hs100", "hs48", "bs24", "bs1"])
def test_paged_attention_unsupported(change: dict[str, Any], reason: str) -> None:
    call = _call("paged_attention", hal_core.load_profile("H100"), **_attention(**change))
    verdict = pa.OP.supports(call)
    assert isinstance(verdict, str) and reason in verdict


@pytest.mark.usefixtures("offload_everything")
@pytest.mark.parametrize("dtype", [np.float32, np.float16, hal_core.arrays.BFLOAT16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_size", pa_rules.PA_HEAD_SIZES)
@pytest.mark.parametrize("block", pa_rules.PA_BLOCK_SIZES)
def test_paged_attention_supported(dtype: Any, head_size: int, block: int) -> None:
    call = _call("paged_attention", hal_core.load_profile("RTX 5090"),
                 **_attention(head_size=head_size, block=block, dtype=dtype))
    assert pa.OP.supports(call) is True


def test_host_arrays_below_offload_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy inputs run on the GPU only from HAL_CUDA_OFFLOAD_MIN_FLOPS; below, the reason names it."""
    args = _attention()
    call = _call("paged_attention", hal_core.load_profile("H100"), **args)
    verdict = pa.OP.supports(call)
    assert isinstance(verdict, str) and "HAL_CUDA_OFFLOAD_MIN_FLOPS" in verdict
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", str(call.flops))
    assert pa.OP.supports(_call("paged_attention", hal_core.load_profile("H100"), **args)) is True


def test_write_kv_cache_never_offloads_by_default() -> None:
    """A pure copy has no FLOPs: host caches always stay on the CPU path."""
    k = np.zeros((4, 2, 64), np.float16)
    cache = np.zeros((2, 2, 16, 64), np.float16)
    call = _call("write_kv_cache", hal_core.load_profile("H100"), key=k, value=k.copy(), key_cache=cache,
                 value_cache=cache.copy(), slot_mapping=np.arange(4, dtype=np.int64))
    assert "HAL_CUDA_OFFLOAD_MIN_FLOPS" in kv.OP.supports(call)


def _gemm_args(rng: np.random.Generator, k: int = 256, n: int = 64, m: int = 4, **quant: Any) -> dict[str, Any]:
    w = rng.standard_normal((k, n)).astype(np.float32)
    return dict(x=rng.standard_normal((m, k)).astype(np.float16), qweight=quantize(w, **quant), out=None)


@pytest.mark.usefixtures("offload_everything")
@pytest.mark.parametrize(("quant", "n", "reason"), [
    (dict(group_size=256), 64, "group_size 256"),
    (dict(group_size=16), 64, "group_size 16"),
    (dict(scale_dtype=np.float32), 64, "float16 scales"),
    (dict(), 66, "multiple of 4"),
], ids=["G256", "G16", "fp32-scales", "N66"])
def test_quantized_gemm_unsupported(rng: np.random.Generator, quant: dict[str, Any], n: int, reason: str) -> None:
    call = _call("quantized_gemm", hal_core.load_profile("A100"), **_gemm_args(rng, n=n, **quant))
    verdict = qg.OP.supports(call)
    assert isinstance(verdict, str) and reason in verdict


@pytest.mark.usefixtures("offload_everything")
def test_quantized_gemm_act_order_unsupported(rng: np.random.Generator) -> None:
    args = _gemm_args(rng)
    qw = args["qweight"]
    args["qweight"] = type(qw)(qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros, bits=4, group_size=128,
                               shape=qw.shape, g_idx=(np.arange(256) // 128).astype(np.int32))
    assert "g_idx" in qg.OP.supports(_call("quantized_gemm", hal_core.load_profile("A100"), **args))


@pytest.mark.usefixtures("offload_everything")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", qg_rules.QGEMM_GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "zeros"])
def test_quantized_gemm_supported(rng: np.random.Generator, bits: int, group_size: int, symmetric: bool) -> None:
    args = _gemm_args(rng, bits=bits, group_size=group_size, symmetric=symmetric)
    assert qg.OP.supports(_call("quantized_gemm", hal_core.load_profile("A100"), **args)) is True


def test_ops_register_with_priority() -> None:
    """register_ops adds one CUDA implementation per op, and declares the ops without one left to the fallback."""
    from hal_cupy.ops import FALLBACK_OPS, register_ops

    from hal_core.ops import OpRegistry

    registry = OpRegistry()
    register_ops(registry, "cuda")
    assert registry.ops() == sorted(set(OPS) - set(FALLBACK_OPS))
    for op in registry.ops():
        (impl,) = registry.implementations(op)
        assert impl.name == f"cuda.{op}" and impl.priority == 100 and isinstance(impl.fn, GpuOp)
    for op in FALLBACK_OPS:
        assert op in OPS and not registry.implementations(op) and not registry.coverage(op).enabled


# -- tensor-core quantised GEMM ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "m", "n", "k", "g"), [
    (4, 1, 28672, 8192, 128), (4, 16, 4096, 4096, 128), (4, 64, 8192, 8192, 64), (4, 128, 1024, 4096, 32),
    (8, 1, 4096, 4096, 64), (8, 2048, 28672, 8192, 128), (4, 7, 136, 96, 32),
], ids=["w4-1x28k", "w4-16x4k", "w4-64x8k", "w4-128x1k", "w8-1x4k", "w8-2048x28k", "w4-tiny"])
def test_tensor_core_gemm_plans_fit(caps: Any, bits: int, m: int, n: int, k: int, g: int) -> None:
    """Grid covers every column tile, M chunk and k-block exactly once; the split stays within its workspace bound."""
    plan, ksplit, per_split = qg_rules.quant_gemm_tc_launch(bits, m, n, k, g, caps.compute_units)
    _config(plan).validate(caps)
    frags = qg_rules.quant_gemm_tc_m_frags(m)
    kblocks = k // 32
    assert plan.grid == (-(-n // 128), ksplit, -(-m // (16 * frags))) and plan.block == (128, 1, 1)
    assert (ksplit - 1) * per_split < kblocks <= ksplit * per_split  # no empty stripe, none missing
    assert ksplit == 1 or ksplit * m * n * 4 <= qg_rules.QGEMM_TC_MAX_WORKSPACE
    ctas = plan.grid[0] * plan.grid[2]
    if ctas < 2 * caps.compute_units and kblocks >= 16:
        assert ksplit > 1  # a small grid is split over K to fill the device
    assert qg_rules.quant_gemm_tc_shared_bytes(bits, frags) <= 48 * 1024
    _config(qg_rules.quant_gemm_tc_reduce_launch(m, n, caps.compute_units)).validate(caps)


class _Platform:
    """A platform whose warp matrix instructions reach ``level`` (0: none)."""

    name = "cuda"

    def __init__(self, level: int) -> None:
        self.level = level

    def warp_mma_level(self, capabilities: hal_core.DeviceCapabilities) -> int:
        return self.level


def _backend(level: int, caps: hal_core.DeviceCapabilities) -> Any:
    device = SimpleNamespace(capabilities=caps)
    return SimpleNamespace(name="cuda", platform=_Platform(level), device=lambda index: device)


def test_tensor_core_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Level 80 and fp16/bf16 activations; W4A16 up to QGEMM_TC_M_MAX rows; HAL_CUDA_TENSOR_CORES=0 opts out."""
    a100 = hal_core.load_profile("NVIDIA A100-SXM4-80GB")
    tc = _backend(80, a100)
    assert qg.uses_tensor_cores(tc, 0, "fp16", 4, 1) and qg.uses_tensor_cores(tc, 0, "bf16", 4, qg_rules.QGEMM_TC_M_MAX)
    assert not qg.uses_tensor_cores(tc, 0, "bf16", 4, qg_rules.QGEMM_TC_M_MAX + 1)
    assert qg.uses_tensor_cores(tc, 0, "bf16", 8, 4096)
    assert not qg.uses_tensor_cores(tc, 0, "fp32", 4, 1) and not qg.uses_tensor_cores(tc, 0, "fp16", 4, 0)
    # Below the level the kernels are written for, or without the instructions: the SIMT kernels.
    assert not qg.uses_tensor_cores(_backend(75, a100), 0, "fp16", 4, 1)
    assert not qg.uses_tensor_cores(_backend(0, a100), 0, "fp16", 4, 1)
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", "0")
    assert not qg.uses_tensor_cores(tc, 0, "fp16", 4, 1)


def test_tensor_core_specs_need_warp_matrix_instructions() -> None:
    """The tensor-core sources carry min_sm (builds without the instructions leave them out), 32-lane warps only."""
    tc = [s for s in all_specializations() if s.source == "quant_gemm_tc.cu"]
    # W4A16 and W8A8 for fp16/bf16, W4A8 for every dtype, W8A8 for fp32: per CTA tile
    assert len(tc) == (2 * 2 + 3 + 1) * len(qg_rules.QGEMM_TC_M_FRAGS) and all(s.min_sm == 80 for s in tc)
    assert all(s.min_sm == 0 for s in all_specializations()
               if s.source not in ("quant_gemm_tc.cu", "paged_attention_tc.cu"))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        qg_rules.quant_gemm_tc_spec("float32", 4, 1)
    assert all(s.min_sm == 0 for s in all_specializations(64))
