"""Kernel correctness on a GPU, per specialisation, against the float64 references on fresh random inputs.

Skipped (lazily, with the probe's reason) where no CUDA device is usable.
``HAL_STRICT=1`` is set, so a call that would fall back to the CPU path fails
instead of passing on the CPU's result. Outputs are poisoned (NaN) first,
so every element must be written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hal_cupy.ops import _paged_attention_rules as pa_rules
from hal_cupy.ops import _quantized_gemm_rules as qg_rules

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import quantize

NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": BFLOAT16}
#: Relative-norm tolerances ||out - ref|| / ||ref|| by output dtype (fp32 arithmetic inside).
TOL = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.5e-2}


@pytest.fixture
def be(cuda_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HAL_STRICT", "1")
    return cuda_backend


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out64).all(), "non-finite output (an element left unwritten?)"
    return float(np.linalg.norm(out64 - ref64) / max(np.linalg.norm(ref64), 1e-30))


def poisoned(be: Any, shape: tuple[int, ...], dtype: str) -> Any:
    return be.asarray(np.full(shape, np.nan, NP_DTYPES[dtype]))


# -- paged_attention ------------------------------------------------------------------------------


def attention_case(rng: np.random.Generator, *, num_seqs: int, heads: int, kv_heads: int, head_size: int,
                   block: int, seq_lens: list[int], dtype: str) -> dict[str, Any]:
    max_blocks = max(1, -(-max(seq_lens) // block))
    num_blocks = num_seqs * max_blocks + 3
    table = rng.permutation(num_blocks)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks).astype(np.int32)
    dt = NP_DTYPES[dtype]
    return dict(
        query=rng.standard_normal((num_seqs, heads, head_size)).astype(dt),
        key_cache=rng.standard_normal((num_blocks, kv_heads, block, head_size)).astype(dt),
        value_cache=rng.standard_normal((num_blocks, kv_heads, block, head_size)).astype(dt),
        block_tables=table, seq_lens=np.asarray(seq_lens, np.int32), scale=float(head_size) ** -0.5,
    )


def run_attention(be: Any, case: dict[str, Any], dtype: str) -> float:
    dev = {k: be.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.items()}
    out = poisoned(be, case["query"].shape, dtype)
    result = be.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
                                    dev["seq_lens"], scale=case["scale"], out=out)
    assert result is out
    return rel_err(be.to_numpy(result), OPS["paged_attention"].reference(case))


@pytest.mark.parametrize("group", [1, 2, 4, 6, 16], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("head_size", pa_rules.PA_HEAD_SIZES, ids=lambda h: f"hs{h}")
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
def test_paged_attention_specialisations(be: Any, rng: np.random.Generator, dtype: str, head_size: int,
                                         group: int) -> None:
    """Every (dtype, head size, GQA tile) compiles and matches, including masked and multi-tile groups."""
    case = attention_case(rng, num_seqs=3, heads=2 * group, kv_heads=2, head_size=head_size, block=16,
                          seq_lens=[0, 37, 300], dtype=dtype)
    assert run_attention(be, case, dtype) < TOL[dtype]


@pytest.mark.parametrize("block", pa_rules.PA_BLOCK_SIZES, ids=lambda b: f"block{b}")
@pytest.mark.parametrize("seq_lens", [[1, 513, 5000], [8192], [4097, 0, 2]], ids=["mixed", "one-long", "zeros"])
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
def test_paged_attention_split_kv(be: Any, rng: np.random.Generator, dtype: str, seq_lens: list[int],
                                  block: int) -> None:
    """Long contexts with few sequences take the split-KV path (partitions + reduce) and match."""
    num_seqs = len(seq_lens)
    variant = pa_rules.choose_paged_attention_variant(num_seqs, 2, max(seq_lens),
                                                      be.device(0).capabilities.compute_units, num_heads=8)
    assert variant == "split"
    case = attention_case(rng, num_seqs=num_seqs, heads=8, kv_heads=2, head_size=128, block=block,
                          seq_lens=seq_lens, dtype=dtype)
    assert run_attention(be, case, dtype) < TOL[dtype]


@pytest.mark.parametrize("heads", [8, 12, 32], ids=lambda h: f"heads{h}")
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
def test_paged_attention_split_kv_gqa_tiles(be: Any, rng: np.random.Generator, dtype: str, heads: int) -> None:
    """Split + reduce over query groups of 4, 6 (one tile of 8, partly masked) and 16 (two tiles) per KV head."""
    group = heads // 2
    tile = pa_rules.paged_attention_gqa_tile(group)
    assert -(-group // tile) == (2 if group == 16 else 1) and (group % tile != 0) == (group == 6)
    cus = be.device(0).capabilities.compute_units
    assert pa_rules.choose_paged_attention_variant(1, 2, 8192, cus, num_heads=heads) == "split"
    case = attention_case(rng, num_seqs=1, heads=heads, kv_heads=2, head_size=128, block=16, seq_lens=[8192],
                          dtype=dtype)
    assert run_attention(be, case, dtype) < TOL[dtype]


def test_paged_attention_single_pass_long(be: Any, rng: np.random.Generator) -> None:
    """Many sequences of a few partitions take the single-pass kernel over > 512 tokens."""
    cus = be.device(0).capabilities.compute_units
    num_seqs = -(-2 * cus // 8)
    assert pa_rules.choose_paged_attention_variant(num_seqs, 8, 1500, cus, num_heads=32) == "single"
    seq_lens = [1500, *(int(n) for n in rng.integers(1, 1500, num_seqs - 1))]
    case = attention_case(rng, num_seqs=num_seqs, heads=32, kv_heads=8, head_size=128, block=16,
                          seq_lens=seq_lens, dtype="fp16")
    assert run_attention(be, case, "fp16") < TOL["fp16"]


def test_paged_attention_returns_new_array_on_device(be: Any, rng: np.random.Generator) -> None:
    """Without out=, the result is a new device array (TaggedArray for bf16) on the inputs' device."""
    import cupy

    case = attention_case(rng, num_seqs=2, heads=4, kv_heads=4, head_size=64, block=8, seq_lens=[5, 9],
                          dtype="bf16")
    dev = {k: be.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.items()}
    out = be.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
                                 dev["seq_lens"], scale=case["scale"])
    assert getattr(out, "hal_dtype", None) == "bf16" and isinstance(out.storage, cupy.ndarray)
    assert rel_err(be.to_numpy(out), OPS["paged_attention"].reference(case)) < TOL["bf16"]


# -- write_kv_cache -------------------------------------------------------------------------------


#: Row bytes for 2-byte dtypes: 256 and 160 (16-byte copies), 72 (8), 68 (4), 66 (2); fp32 doubles them.
WRITE_KV_HEAD_SIZES = [128, 80, 36, 34, 33]


@pytest.mark.parametrize("head_size", WRITE_KV_HEAD_SIZES, ids=lambda h: f"hs{h}")
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=["slot32", "slot64"])
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
def test_write_kv_cache(be: Any, rng: np.random.Generator, dtype: str, slot_dtype: Any, head_size: int) -> None:
    """Rows land exactly at their slots (negative slots skipped), for every vector width the kernel picks
    (16, 8, 4 and 2 bytes with fp16/bf16)."""
    dt = NP_DTYPES[dtype]
    num_blocks, kv_heads, block, tokens = 6, 2, 16, 40
    key = rng.standard_normal((tokens, kv_heads, head_size)).astype(dt)
    value = rng.standard_normal((tokens, kv_heads, head_size)).astype(dt)
    cache_k = rng.standard_normal((num_blocks, kv_heads, block, head_size)).astype(dt)
    cache_v = rng.standard_normal((num_blocks, kv_heads, block, head_size)).astype(dt)
    slots = rng.permutation(num_blocks * block)[:tokens].astype(slot_dtype)
    slots[::7] = -1
    args = dict(key=key, value=value, key_cache=cache_k, value_cache=cache_v, slot_mapping=slots)
    want_k, want_v = OPS["write_kv_cache"].reference(args)
    dk, dv = be.asarray(cache_k), be.asarray(cache_v)
    be.ops.write_kv_cache(be.asarray(key), be.asarray(value), dk, dv, be.asarray(slots))
    np.testing.assert_array_equal(be.to_numpy(dk).astype(np.float64), want_k)
    np.testing.assert_array_equal(be.to_numpy(dv).astype(np.float64), want_v)


# -- quantized_gemm -------------------------------------------------------------------------------


def run_gemm(be: Any, rng: np.random.Generator, *, m: int, k: int, n: int, dtype: str, **quant: Any) -> float:
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    qw = quantize(w, **quant)
    x = rng.standard_normal((m, k)).astype(NP_DTYPES[dtype])
    out = poisoned(be, (m, n), dtype)
    result = be.ops.quantized_gemm(be.asarray(x), qw.map_arrays(be.asarray), out=out)
    assert result is out
    return rel_err(be.to_numpy(result), OPS["quantized_gemm"].reference(dict(x=x, qweight=qw)))


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 32, 33, 200], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_quantized_gemm_m_tiles(be: Any, rng: np.random.Generator, bits: int, dtype: str, m: int) -> None:
    """Every M tile of the fused kernel (with split-K), and the dequantise + cuBLAS path above the threshold."""
    assert run_gemm(be, rng, m=m, k=2048, n=384, dtype=dtype, bits=bits, group_size=128) < 2 * TOL[dtype]


@pytest.mark.parametrize("m", [5, 64], ids=["fused", "dense"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "zeros"])
@pytest.mark.parametrize("group_size", qg_rules.QGEMM_GROUP_SIZES, ids=lambda g: f"G{g}")
@pytest.mark.parametrize("bits", [4, 8], ids=["W4A16", "W8A8"])
def test_quantized_gemm_groups(be: Any, rng: np.random.Generator, bits: int, group_size: int, symmetric: bool,
                               m: int) -> None:
    """Group sizes 32/64/128, symmetric or with zero points, on both paths."""
    err = run_gemm(be, rng, m=m, k=1024, n=4096 + 128, dtype="fp16", bits=bits, group_size=group_size,
                   symmetric=symmetric)
    assert err < 2 * TOL["fp16"]


def test_host_inputs_offload_above_threshold(be: Any, rng: np.random.Generator,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy in, numpy out: computed on the GPU when the FLOP threshold allows it."""
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "0")
    w = rng.standard_normal((512, 256)).astype(np.float32)
    qw = quantize(w)
    x = rng.standard_normal((4, 512)).astype(np.float16)
    out = np.full((4, 256), np.nan, np.float16)
    result = be.ops.quantized_gemm(x, qw, out=out)
    assert result is out and isinstance(result, np.ndarray)
    assert rel_err(result, OPS["quantized_gemm"].reference(dict(x=x, qweight=qw))) < 2 * TOL["fp16"]
