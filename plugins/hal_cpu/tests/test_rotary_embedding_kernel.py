"""The compiled rotary_embedding kernel: every dtype and ISA variant, both styles, partial rotary, odd sizes,
strided (fused-QKV) views, threads 1 and 2, NaN in -> NaN out; against the float64 reference."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hal_cpu.ops import rotary_embedding

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, rotary_embedding_inputs

REFERENCE = OPS["rotary_embedding"].reference


def _fused(rng: np.random.Generator, args: dict) -> None:
    """Replace query and key by slices of one [tokens, q + k + v heads, head_size] projection holding their values."""
    query, key = args["query"], args["key"]
    heads, kv_heads = query.shape[1], key.shape[1]
    qkv = rng.standard_normal((query.shape[0], heads + 2 * kv_heads, query.shape[2])).astype(query.dtype)
    qkv[:, :heads], qkv[:, heads: heads + kv_heads] = query, key
    args["query"], args["key"] = qkv[:, :heads], qkv[:, heads: heads + kv_heads]
    args["_qkv"] = qkv


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize(("head_size", "rotary_dim"), [(128, 128), (80, 32), (96, 70), (64, 2), (40, 38)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("threads", [1, 2])
def test_rotation_matches_reference(variant: str, dtype: str, style: str, head_size: int, rotary_dim: int,
                                    threads: int) -> None:
    """Rows of odd counts and odd rotary widths (vector bodies and scalar tails) rotate as the reference says."""
    seed = zlib.crc32(f"{dtype}-{style}-{head_size}-{rotary_dim}-{threads}".encode())
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    args = rotary_embedding_inputs(rng, num_tokens=37, num_heads=5, num_kv_heads=3, head_size=head_size,
                                   dtype=dtype, rotary_dim=rotary_dim, max_position=300)
    args["style"] = style
    _fused(rng, args)
    value_before = args["_qkv"][:, 8:].copy()
    want_q, want_k = REFERENCE(args)
    rotary_embedding.rotate(args["positions"], args["query"], args["cos_sin_cache"], args["key"], style=style,
                            threads=threads)
    assert_close(args["query"], want_q, kind="rotary", dtype=dtype, what="query")
    assert_close(args["key"], want_k, kind="rotary", dtype=dtype, what="key")
    np.testing.assert_array_equal(args["_qkv"][:, 8:].view(np.uint8), value_before.view(np.uint8))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_nan_in_nan_out(variant: str, dtype: str, style: str) -> None:
    """A NaN (and an infinity) reaches exactly the values the reference makes non-finite; the pass-through stays."""
    rng = np.random.default_rng(11)
    args = rotary_embedding_inputs(rng, num_tokens=9, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
                                   rotary_dim=48, max_position=20)
    args["style"] = style
    args["query"][3, 1, 7] = np.nan
    args["key"][5, 0, 2] = np.inf
    args["query"][0, 0, 60] = np.nan  # past rotary_dim: left as it is
    want_q, want_k = REFERENCE(args)
    rotary_embedding.rotate(args["positions"], args["query"], args["cos_sin_cache"], args["key"], style=style)
    assert np.isnan(want_q).sum() == 3 and not np.isfinite(want_k).all()
    assert_close(args["query"], want_q, kind="rotary", dtype=dtype, what="query")
    assert_close(args["key"], want_k, kind="rotary", dtype=dtype, what="key")


def test_query_alone_and_int32_positions(variant: str) -> None:
    """key=None rotates only the query; int32 and int64 positions give the same result."""
    rng = np.random.default_rng(5)
    args = rotary_embedding_inputs(rng, num_tokens=300, num_heads=8, num_kv_heads=1, head_size=128, dtype="bf16",
                                   with_key=False, max_position=4096)
    (want_q,) = REFERENCE(args)
    results = []
    for dtype in (np.int32, np.int64):
        query = args["query"].copy()
        rotary_embedding.rotate(args["positions"].astype(dtype), query, args["cos_sin_cache"], None, threads=2)
        assert_close(query, want_q, kind="rotary", dtype="bf16", what="query")
        results.append(query)
    np.testing.assert_array_equal(results[0].view(np.uint16), results[1].view(np.uint16))


def test_head_strided_views_and_the_numpy_path_agree(variant: str) -> None:
    """Heads need not be adjacent (every other head of a wider array); the numpy path gives the same values."""
    rng = np.random.default_rng(9)
    args = rotary_embedding_inputs(rng, num_tokens=20, num_heads=3, num_kv_heads=2, head_size=64, dtype="fp32",
                                   rotary_dim=32, max_position=50)
    wide = np.zeros((20, 6, 64), np.float32)
    wide[:, ::2] = args["query"]
    args["query"] = wide[:, ::2]
    want_q, want_k = REFERENCE(args)
    numpy_q, numpy_k = args["query"].copy(), args["key"].copy()
    rotary_embedding.rotate(args["positions"], args["query"], args["cos_sin_cache"], args["key"])
    rotary_embedding._numpy_rotate(args["positions"], numpy_q, args["cos_sin_cache"], numpy_k, None)
    for got, want in ((args["query"], want_q), (args["key"], want_k), (numpy_q, want_q), (numpy_k, want_k)):
        assert_close(got, want, kind="rotary", dtype="fp32")
    np.testing.assert_array_equal(wide[:, 1::2], 0.0)
