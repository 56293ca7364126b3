"""The compiled sample kernel against the float64 reference: every dtype, odd vocabularies, strided rows,
threads 1 and 2, every ISA variant this CPU runs; NaN rows give -1."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import sample

from hal_core.testing.inputs import sample_inputs
from hal_core.testing.sampling import assert_same_tokens

_OPTIONAL = ("top_k", "top_p", "min_p")


def _draw(args: dict[str, Any], threads: int | None = None) -> np.ndarray:
    return sample.draw_tokens(args["logits"], args["temperature"], args["seeds"],
                              *(args.get(n) for n in _OPTIONAL), threads=threads)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("vocab", [1, 7, 33, 32000, 151936])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("threads", [1, 2])
def test_sample_kernel_matches_reference(variant: str, rng: np.random.Generator, dtype: str, vocab: int,
                                         strided: bool, threads: int) -> None:
    """Mixed greedy and filtered rows: each row's token is the reference's for its seed."""
    args = sample_inputs(rng, num_seqs=6, vocab_size=vocab, dtype=dtype, strided=strided)
    assert_same_tokens(_draw(args, threads), args)


def test_sample_kernel_variants_and_threads_agree(select_isa: Callable[[str], AbstractContextManager[None]],
                                                   rng: np.random.Generator) -> None:
    """Every variant and thread count draws the reference's tokens for 64 rows of a 50k vocabulary."""
    args = sample_inputs(rng, num_seqs=64, vocab_size=50000, dtype="bf16", scale=2.0)
    for name in _native.load().available:
        with select_isa(name):
            for threads in (1, 2):
                assert_same_tokens(_draw(args, threads), args)


@pytest.mark.parametrize("top_k", [1, 2, 50, 999, 1000, 5000])
def test_sample_kernel_top_k_ties(variant: str, rng: np.random.Generator, top_k: int) -> None:
    """Logits on a coarse grid (many ties): top-k keeps every tie of the k-th value, as the reference."""
    rows = 32
    logits = np.round(rng.standard_normal((rows, 1000)) * 2).astype(np.float32)
    args = {"logits": logits, "temperature": np.full(rows, 1.0, np.float32),
            "seeds": rng.integers(0, 2**62, rows, dtype=np.int64), "top_k": np.full(rows, top_k, np.int32)}
    assert_same_tokens(_draw(args), args)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("min_p", [0.0, 0.1, 1.0])
def test_sample_kernel_top_p_min_p(variant: str, rng: np.random.Generator, top_p: float, min_p: float) -> None:
    """top-p over a ties-heavy row and min-p up to 1 (only the maximum's ties kept): the reference's tokens."""
    rows = 32
    logits = (np.round(rng.standard_normal((rows, 777)) * 4) / 2).astype(np.float32)
    args = {"logits": logits, "temperature": rng.uniform(0.2, 2.0, rows).astype(np.float32),
            "seeds": rng.integers(-2**63, 2**62, rows, dtype=np.int64), "top_p": np.full(rows, top_p, np.float32),
            "min_p": np.full(rows, min_p, np.float32)}
    assert_same_tokens(_draw(args), args)


def test_sample_kernel_nan_and_infinite_rows(variant: str) -> None:
    """NaN anywhere or only -inf: -1; -inf tokens are never drawn; a +inf maximum draws among its +inf tokens."""
    rows, vocab = 64, 70
    logits = np.zeros((rows, vocab), np.float32)
    logits[:, ::2] = -np.inf
    logits[0, 69] = np.nan
    logits[1] = -np.inf
    logits[2, [3, 41]] = np.inf
    logits[3, 1] = np.nan
    temperature = np.ones(rows, np.float32)
    temperature[3] = 0.0
    args = {"logits": logits, "temperature": temperature, "seeds": np.arange(rows, dtype=np.int64)}
    got = _draw(args)
    assert got[:4].tolist()[:2] == [-1, -1] and got[2] in (3, 41) and got[3] == -1
    assert (got[4:] % 2 == 1).all()
    assert_same_tokens(got, args)


def test_sample_kernel_greedy_first_maximum(variant: str, rng: np.random.Generator) -> None:
    """Temperature 0: the lowest index among tied maxima, in every dtype's rounding."""
    logits = rng.standard_normal((4, 3000)).astype(np.float32)
    logits[:, [2999, 17, 1500]] = 9.0
    args = {"logits": logits, "temperature": np.zeros(4, np.float32), "seeds": np.zeros(4, np.int64),
            "top_k": np.full(4, 3, np.int32)}
    np.testing.assert_array_equal(_draw(args), [17, 17, 17, 17])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_sample_kernel_greedy_over_chunks(variant: str, rng: np.random.Generator, dtype: str) -> None:
    """Greedy rows of a 128k vocabulary (32 of the kernel's 4096-logit chunks): the first maximum when ties fall
    in different chunks, at a chunk's last and next chunk's first logit, a later larger maximum, a NaN after the
    maximum, a row of -inf; fp16/bf16 values that round to the same maximum tie too."""
    from hal_core.arrays import numpy_dtype

    vocab = 128256
    logits = rng.uniform(-4.0, 4.0, (8, vocab)).astype(np.float32)
    logits[0, [4095, 4096, 9000]] = 7.0  # tied across chunks: the first
    logits[1, [4096, 8191]] = 7.0  # a chunk's first logit
    logits[2, 100] = 7.0
    logits[2, vocab - 1] = 7.5  # a larger maximum in the last, partial chunk
    logits[3, 5] = 7.0
    logits[3, 70000] = np.nan  # NaN after the maximum: -1
    logits[4] = -np.inf
    logits[5, 3] = np.inf
    logits[5, 4] = np.inf
    logits[6, [20000, 60000]] = [7.0, 7.0 + 2.0 ** -20]  # one value in fp16/bf16, larger in fp32
    logits[7] = -np.inf
    logits[7, 130] = -1e30 if dtype != "fp16" else -60000.0  # only one finite logit
    x = logits.astype(numpy_dtype(dtype))
    args = {"logits": x, "temperature": np.zeros(8, np.float32), "seeds": np.zeros(8, np.int64)}
    want = [4095, 4096, vocab - 1, -1, -1, 3, 20000 if dtype != "fp32" else 60000, 130]
    np.testing.assert_array_equal(_draw(args), want)
    np.testing.assert_array_equal(_draw(args, threads=1), want)


def test_sample_kernel_seed_alone_decides(rng: np.random.Generator) -> None:
    """The same seed gives the same token whatever the batch around it; another seed may not."""
    args = sample_inputs(rng, num_seqs=8, vocab_size=4000, dtype="fp32", greedy=False)
    args["temperature"][:] = 1.0
    first = _draw(args)
    swapped = {k: v[::-1].copy() for k, v in args.items()}
    np.testing.assert_array_equal(_draw(swapped), first[::-1])


def test_sample_fallback_without_library(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """Without the compiled library the float64 definition answers, with the same tokens."""
    args = sample_inputs(rng, num_seqs=5, vocab_size=300, dtype="fp16")
    expected = _draw(args)
    monkeypatch.setattr(_native, "try_load", lambda: None)
    assert_same_tokens(_draw(args), args)
    assert_same_tokens(expected, args)
