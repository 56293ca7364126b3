"""Tensor-core decode attention on a GPU: the same calls with ``HAL_CUDA_TENSOR_CORES`` 1 and 0 (SIMT), against
the float64 reference, with NaN-poisoned unused cache slots and non-finite inputs.

Skipped (lazily, with the probe's reason) where no CUDA device is usable; the tensor-core cases skip on GPUs
below sm_80.  ``HAL_STRICT=1``: a CPU fallback fails the test.  The host-compiled emulation of the same kernel
is ``test_tc_attention_host.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hal_cupy.ops import _paged_attention
from hal_cupy.ops import _paged_attention_rules as pa_rules

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.testing.tolerances import tolerance

NP_DTYPES = {"fp16": np.float16, "bf16": BFLOAT16}


@pytest.fixture
def be(cuda_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HAL_STRICT", "1")
    return cuda_backend


def _case(rng: np.random.Generator, num_heads: int, num_kv_heads: int, head_size: int, block: int,
          seq_lens: list[int], dtype: str) -> dict[str, Any]:
    """Inputs whose unused cache slots (tails of last blocks, spare blocks) are NaN."""
    dt = NP_DTYPES[dtype]
    used = [-(-n // block) for n in seq_lens]
    max_blocks = max(1, max(used)) + 1
    num_blocks = sum(used) + 2
    kc = rng.standard_normal((num_blocks, num_kv_heads, block, head_size)).astype(dt)
    vc = rng.standard_normal(kc.shape).astype(dt)
    perm = rng.permutation(num_blocks).astype(np.int32)
    table = np.empty((len(seq_lens), max_blocks), np.int32)
    nxt = 0
    for s, (n, nb) in enumerate(zip(seq_lens, used, strict=True)):
        table[s, :nb] = perm[nxt:nxt + nb]
        table[s, nb:] = perm[-1]
        nxt += nb
        if n % block:
            kc[table[s, nb - 1], :, n % block:] = np.nan
            vc[table[s, nb - 1], :, n % block:] = np.nan
    kc[perm[-2:]] = np.nan
    vc[perm[-2:]] = np.nan
    return dict(query=rng.standard_normal((len(seq_lens), num_heads, head_size)).astype(dt), key_cache=kc,
                value_cache=vc, block_tables=table, seq_lens=np.asarray(seq_lens, np.int32),
                scale=float(head_size) ** -0.5)


def _run(be: Any, case: dict[str, Any], dtype: str) -> np.ndarray:
    dev = {k: be.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.items()}
    out = be.asarray(np.full(case["query"].shape, np.nan, NP_DTYPES[dtype]))
    result = be.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
                                    dev["seq_lens"], scale=case["scale"], out=out)
    return np.asarray(be.to_numpy(result), np.float64)


def _expect_path(be: Any, dtype: str, heads: int, kv: int, head_size: int, tensor_cores: str) -> None:
    caps = be.device(0).capabilities
    uses = _paged_attention.uses_tensor_cores(be, 0, dtype, heads, kv, head_size)
    if tensor_cores == "1" and not uses:
        pytest.skip(f"{caps.name} ({caps.arch}) has no tensor-core attention (sm_{pa_rules.PA_TC_MIN_SM}+ needed)")
    assert uses == (tensor_cores == "1")


@pytest.mark.parametrize("tensor_cores", ["1", "0"], ids=["tc", "simt"])
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize(("heads", "kv", "head_size", "block", "seq_lens"), [
    (32, 8, 128, 16, [1, 77, 4097, 0]),
    (32, 8, 128, 16, [32768]),
    (16, 1, 256, 32, [300, 1, 1000]),
    (8, 2, 64, 8, [8192, 5]),
    (64, 2, 192, 16, [45, 2000]),
], ids=["gqa32x8-mixed", "gqa32x8-32k", "group16-hs256", "group4-hs64", "group32-hs192"])
def test_tc_attention_matches_reference(be: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                        tensor_cores: str, dtype: str, heads: int, kv: int, head_size: int,
                                        block: int, seq_lens: list[int]) -> None:
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", tensor_cores)
    _expect_path(be, dtype, heads, kv, head_size, tensor_cores)
    case = _case(rng, heads, kv, head_size, block, seq_lens, dtype)
    got = _run(be, case, dtype)
    expected = OPS["paged_attention"].reference(case)
    assert np.isfinite(got).all(), "NaN from an unused slot, or an output element left unwritten"
    atol, rtol = tolerance("attention", dtype)
    np.testing.assert_allclose(got, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("tensor_cores", ["1", "0"], ids=["tc", "simt"])
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
def test_tc_attention_non_finite(be: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                 tensor_cores: str, dtype: str) -> None:
    """NaN in a query head, +inf in a used key, NaN in a used value: NaN exactly where float64 has it."""
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", tensor_cores)
    _expect_path(be, dtype, 32, 8, 128, tensor_cores)
    case = _case(rng, 32, 8, 128, 16, [600, 90, 3000], dtype)
    bt = case["block_tables"]
    case["query"][0, 5, 9] = np.nan
    case["key_cache"][bt[1, 2], 3, 4, 10] = np.inf
    case["value_cache"][bt[2, 100], 6, 7, 11] = np.nan
    got = _run(be, case, dtype)
    expected = OPS["paged_attention"].reference(case)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    atol, rtol = tolerance("attention", dtype)
    np.testing.assert_allclose(got, expected, atol=atol, rtol=rtol)
