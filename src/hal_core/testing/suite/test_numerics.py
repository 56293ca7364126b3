"""NaN and infinity in, exactly what the float64 reference says out; poison in unused cache slots never read.

The semantics are defined once, in hal-core: :mod:`hal_core.ops.paged_attention`
(IEEE arithmetic through ``exp(x - max) / sum``) and
:func:`hal_core.quant.quantize_activations` (a W8A8 row holding NaN or an
infinity gives a NaN output row). :func:`hal_core.testing.inputs.assert_close`
requires NaN where the reference has NaN, the same infinity where it has
one, and finite values within tolerance everywhere else.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, paged_attention_inputs, quantized_gemm_inputs, to_backend
from hal_core.testing.suite._strategies import DTYPES

ATTENTION = OPS["paged_attention"].reference
GEMM = OPS["quantized_gemm"].reference

#: Sequence lengths: one long enough to span several partitions of a split-KV kernel, an empty one.
SEQ_LENS = [37, 1500, 0, 5]
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16


def _rng(hal_seed: int, test: str) -> np.random.Generator:
    stream = zlib.crc32(test.encode())
    print(f"hal seed: --hal-seed={hal_seed} (test stream {stream})")
    return np.random.default_rng([hal_seed, stream])


def _slot(args: dict[str, Any], seq: int, token: int) -> tuple[int, int]:
    """(block, offset) of a used token of sequence ``seq``."""
    assert token < args["seq_lens"][seq]
    return int(args["block_tables"][seq, token // BLOCK_SIZE]), token % BLOCK_SIZE


def _poison(case: str, args: dict[str, Any]) -> None:
    """Put the non-finite values ``case`` names into ``args`` (host arrays, changed in place)."""
    q, kc, vc = args["query"], args["key_cache"], args["value_cache"]
    if case == "query-nan":  # head 3 of sequence 0: that head's row is NaN
        q[0, 3, 10] = np.nan
    elif case == "query-inf":  # +-inf scores: the max is infinite, the row NaN
        q[1, 5, 2] = np.inf
    elif case == "query-nan-empty-sequence":  # a sequence of length 0 still gives zeros
        q[2, :, :] = np.nan
    elif case == "key-nan-late-partition":  # a used key far into the long sequence
        block, offset = _slot(args, 1, 1200)
        kc[block, 1, offset, 4] = np.nan
    elif case == "key-inf":  # score +inf (row NaN) or -inf (token ignored), as q's sign says
        block, offset = _slot(args, 0, 10)
        kc[block, 0, offset, 0] = np.inf
        block, offset = _slot(args, 1, 900)
        kc[block, 1, offset, 1] = -np.inf
    elif case == "value-nan":  # reaches only that element of the heads reading it
        block, offset = _slot(args, 0, 3)
        vc[block, 0, offset, 7] = np.nan
    elif case == "value-inf":
        block, offset = _slot(args, 1, 1100)
        vc[block, 1, offset, 9] = np.inf
        block, offset = _slot(args, 3, 4)
        vc[block, 0, offset, 2] = -np.inf
    elif case == "value-inf-both-signs":  # +inf and -inf in one output element: NaN
        block, offset = _slot(args, 1, 20)
        vc[block, 0, offset, 5] = np.inf
        block, offset = _slot(args, 1, 1400)
        vc[block, 0, offset, 5] = -np.inf
    elif case == "unused-slots-inf":  # unused slots hold +-inf instead of NaN: still never read
        for cache in (kc, vc):
            unused = np.isnan(cache.astype(np.float32))
            signs = np.where(np.arange(unused.sum()) % 2 == 0, np.inf, -np.inf)
            cache[unused] = signs.astype(cache.dtype)
    elif case != "unused-slots-nan":  # paged_attention_inputs already poisons unused slots with NaN
        raise AssertionError(f"unknown case {case}")


ATTENTION_CASES = [
    "unused-slots-nan",
    "unused-slots-inf",
    "query-nan",
    "query-inf",
    "query-nan-empty-sequence",
    "key-nan-late-partition",
    "key-inf",
    "value-nan",
    "value-inf",
    "value-inf-both-signs",
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_non_finite_inputs(hal_backend: Any, hal_seed: int, dtype: str, case: str) -> None:
    """NaN/inf in the query, used keys or used values propagate as the reference says; unused slots never do."""
    rng = _rng(hal_seed, f"paged_attention-{dtype}-{case}")
    args = paged_attention_inputs(rng, seq_lens=SEQ_LENS, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                  head_size=HEAD_SIZE, block_size=BLOCK_SIZE, dtype=dtype)
    _poison(case, args)
    expected = ATTENTION(args)
    if case.startswith(("query-nan", "query-inf", "key-nan", "value")) and case != "query-nan-empty-sequence":
        assert not np.isfinite(expected).all(), "the case must reach the reference's result"
    dev = to_backend(hal_backend, "paged_attention", args)
    result = hal_backend.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                                             dev["block_tables"], dev["seq_lens"], scale=args["scale"])
    got = np.asarray(hal_backend.to_numpy(result))
    assert_close(got, expected, kind="attention", dtype=dtype, what=f"paged_attention ({case})")
    if case == "query-nan-empty-sequence":
        assert not got[2].astype(np.float64).any(), "a sequence of length 0 gives zeros"


#: Rows of x and what is put there: 0, 2 and 6.. finite; 1 NaN; 3 +inf; 4 -inf; 5 NaN and +inf.
GEMM_ROWS = {1: [np.nan], 3: [np.inf], 4: [-np.inf], 5: [np.nan, np.inf]}


@pytest.mark.parametrize("m", [6, 80], ids=["decode", "prefill"])  # GPU kernels differ for small and large M
@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act-order"])
@pytest.mark.parametrize("bits", [4, 8], ids=["w4a16", "w8a8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_gemm_non_finite_activations(hal_backend: Any, hal_seed: int, dtype: str, bits: int,
                                               act_order: bool, m: int) -> None:
    """NaN/inf activations give the reference's result: W8A8 rows with any of them are all NaN."""
    rng = _rng(hal_seed, f"quantized_gemm-{dtype}-{bits}-{act_order}-{m}")
    args = quantized_gemm_inputs(rng, m=m, k=256, n=64, bits=bits, group_size=64, symmetric=bits == 4,
                                 dtype=dtype, act_order=act_order)
    x = args["x"]
    for row, values in GEMM_ROWS.items():
        columns = rng.choice(x.shape[1], size=len(values), replace=False)
        x[row, columns] = np.asarray(values).astype(x.dtype)
    expected = GEMM(args)
    assert np.isfinite(expected[[0, 2]]).all() and np.isfinite(expected[6:]).all()
    assert np.isnan(expected[[1, 5]]).all()
    if bits == 8:  # defined once in hal-core: a W8A8 row holding NaN or an infinity gives a NaN row
        assert np.isnan(expected[3:6]).all()
    dev = to_backend(hal_backend, "quantized_gemm", args)
    got = np.asarray(hal_backend.to_numpy(hal_backend.ops.quantized_gemm(dev["x"], dev["qweight"])))
    assert_close(got, expected, kind="gemm", dtype=dtype, what=f"quantized_gemm (int{bits})")
