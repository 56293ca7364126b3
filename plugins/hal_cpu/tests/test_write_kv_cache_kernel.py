"""The compiled write_kv_cache scatter: strided key/value views, int32/int64 slots, skipped slots; bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
from hal_cpu.ops import write_kv_cache

from hal_core.ops import OPS
from hal_core.testing.inputs import write_kv_cache_inputs

REFERENCE = OPS["write_kv_cache"].reference


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "fused-qkv-views"])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_scatter_matches_reference(variant: str, rng: np.random.Generator, dtype: str, slot_dtype: type,
                                   fused: bool, num_tokens: int) -> None:
    """Rows land bit-exactly in their slots; skipped and unwritten slots keep their NaN poison."""
    args = write_kv_cache_inputs(rng, num_tokens=num_tokens, num_blocks=40, num_kv_heads=4, block_size=16,
                                 head_size=64, dtype=dtype)
    args["slot_mapping"] = args["slot_mapping"].astype(slot_dtype)
    if fused:  # key and value as slices of one [tokens, q + k + v heads, head_size] projection
        qkv = rng.standard_normal((num_tokens, 16, 64)).astype(args["key"].dtype)
        qkv[:, 8:12], qkv[:, 12:16] = args["key"], args["value"]
        args["key"], args["value"] = qkv[:, 8:12], qkv[:, 12:16]
        assert num_tokens == 1 or not args["key"].flags.c_contiguous
    expected_k, expected_v = REFERENCE(args)
    write_kv_cache.scatter(args["key"], args["value"], args["key_cache"], args["value_cache"],
                           args["slot_mapping"], threads=2)
    for got, expected in ((args["key_cache"], expected_k), (args["value_cache"], expected_v)):
        np.testing.assert_array_equal(got.astype(np.float64), expected)  # NaN where expected NaN, else equal


def test_head_strided_views(rng: np.random.Generator) -> None:
    """Key heads need not be adjacent (a view taking every other head); only head_size must be contiguous."""
    args = write_kv_cache_inputs(rng, num_tokens=20, num_blocks=8, num_kv_heads=2, block_size=8, head_size=32,
                                 dtype="fp16")
    wide = np.zeros((20, 4, 32), dtype=np.float16)
    wide[:, ::2] = args["key"]
    args["key"] = wide[:, ::2]
    expected_k, _ = REFERENCE(args)
    write_kv_cache.scatter(args["key"], args["value"], args["key_cache"], args["value_cache"], args["slot_mapping"])
    np.testing.assert_array_equal(args["key_cache"].astype(np.float64), expected_k)
