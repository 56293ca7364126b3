"""CPU op internals: chunking and partitions agree with the reference, the dequantisation cache works."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hal_cpu.ops import paged_attention, quantized_gemm

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, paged_attention_inputs, quantized_gemm_inputs


@pytest.mark.parametrize(("budget", "partition"), [(1, 8), (4096, 32), (1 << 30, 1 << 20)],
                         ids=["one-seq-chunks", "small", "one-chunk"])
def test_attention_chunks_and_partitions_agree(rng: np.random.Generator, budget: int, partition: int) -> None:
    """Any chunk budget and partition size gives the reference result (online softmax merge)."""
    args = paged_attention_inputs(rng, seq_lens=[0, 1, 17, 64, 300, 5], num_heads=8, num_kv_heads=2,
                                  head_size=64, block_size=8, dtype="fp32")
    got = paged_attention.attend(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                 args["seq_lens"], args["scale"], budget=budget, partition_tokens=partition)
    assert_close(got, OPS["paged_attention"].reference(args), kind="attention", dtype="fp32")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_widening_is_exact(rng: np.random.Generator, dtype: str) -> None:
    """Bit-arithmetic widening equals numpy's cast for every value class (subnormals, zeros, inf, nan)."""
    from hal_core.arrays import numpy_dtype

    np_dtype = numpy_dtype(dtype)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, -6e-8, 1e-5, 65504.0, 1e-40]
    values = np.concatenate([rng.standard_normal(200_000) * 10.0 ** rng.integers(-6, 5, 200_000), specials])
    values = values.astype(np_dtype)
    if dtype == "fp16":  # every bit pattern
        values = np.concatenate([values, np.arange(65536, dtype=np.uint16).view(np.float16)])
    np.testing.assert_array_equal(paged_attention.to_float32(values), values.astype(np.float32))


def test_dequant_cache_reuses_and_forgets(rng: np.random.Generator) -> None:
    """The float32 weight is cached per QuantizedWeight and dropped when the weight is collected."""
    quantized_gemm.clear_dequant_cache()
    args = quantized_gemm_inputs(rng, m=2, k=64, n=8, bits=4, group_size=32, symmetric=False, dtype="fp32")
    qweight = args["qweight"]
    first = quantized_gemm.dequantize_float32(qweight)
    assert quantized_gemm.dequantize_float32(qweight) is first
    np.testing.assert_array_equal(first, qweight.dequantize(np.float32))
    assert quantized_gemm._cache.nbytes == first.nbytes
    del qweight, args
    gc.collect()
    assert quantized_gemm._cache.nbytes == 0


def test_w8a8_large_groups_use_exact_accumulation(rng: np.random.Generator) -> None:
    """With G large enough to overflow float32's exact range, accumulation switches to float64."""
    args = quantized_gemm_inputs(rng, m=3, k=1024, n=4, bits=8, group_size=1024, symmetric=False, dtype="fp32")
    got = quantized_gemm._w8a8(args["x"], args["qweight"])
    np.testing.assert_allclose(got, OPS["quantized_gemm"].reference(args), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("w8a8_first", [True, False], ids=["w8a8-first", "dequantize-first"])
def test_dequant_cache_keeps_float_weights_and_centered_codes_apart(rng: np.random.Generator,
                                                                    w8a8_first: bool) -> None:
    """One int8 weight's float32 weight and its centred codes are cached apart, in either order."""
    quantized_gemm.clear_dequant_cache()
    args = quantized_gemm_inputs(rng, m=3, k=128, n=8, bits=8, group_size=64, symmetric=False, dtype="fp32")
    x, qweight = args["x"], args["qweight"]
    expected_y, expected_w = OPS["quantized_gemm"].reference(args), qweight.dequantize(np.float64)
    for step in ("w8a8", "float32") if w8a8_first else ("float32", "w8a8"):
        for _ in range(2):  # the second round reads the cache
            if step == "w8a8":
                np.testing.assert_allclose(quantized_gemm._w8a8(x, qweight), expected_y, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_allclose(quantized_gemm.dequantize_float32(qweight), expected_w, rtol=1e-6)


def test_dequant_cache_collection_while_locked_does_not_deadlock(rng: np.random.Generator) -> None:
    """A weight collected while the cache's lock is held (a GC inside put) only queues its entry's removal."""
    quantized_gemm.clear_dequant_cache()
    qweight = quantized_gemm_inputs(rng, m=1, k=64, n=8, bits=4, group_size=32, symmetric=True,
                                    dtype="fp32")["qweight"]
    quantized_gemm.dequantize_float32(qweight)
    cache = quantized_gemm._cache
    with cache._lock:  # the weakref callback must not take this (non-reentrant) lock
        del qweight
        gc.collect()
    assert cache.nbytes == 0
