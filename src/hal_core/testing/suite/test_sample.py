"""sample against the float64 reference: the same token for the same seed, greedy, special rows, errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hal_core import ArgumentError, ArgumentTypeError
from hal_core.testing.inputs import sample_inputs, to_backend
from hal_core.testing.sampling import assert_same_tokens, kept_weights, run_sample

_OPTIONAL = ("top_k", "top_p", "min_p")


VOCABS = (1, 7, 32000, 151936)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS, ids=[f"v{v}" for v in VOCABS])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_sample_matches_reference(hal_backend: Any, hal_rng: np.random.Generator, dtype: str, vocab: int,
                                  strided: bool) -> None:
    """Temperature, top-k, top-p and min-p mixed per row: the reference's token for each row's seed."""
    args = sample_inputs(hal_rng, num_seqs=5, vocab_size=vocab, dtype=dtype, strided=strided)
    assert_same_tokens(run_sample(hal_backend, args), args)


@pytest.mark.parametrize("missing", _OPTIONAL)
def test_sample_optional_parameters_off(hal_backend: Any, hal_rng: np.random.Generator, missing: str) -> None:
    """Each optional parameter left out (None): the reference's token with that filter off."""
    args = sample_inputs(hal_rng, num_seqs=6, vocab_size=500, dtype="fp32", **{missing: False})
    assert_same_tokens(run_sample(hal_backend, args), args)


def test_sample_many_seeds_one_row(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """One distribution drawn with 512 seeds (every filter on): each draw is the reference's."""
    rows = 512
    row = (hal_rng.standard_normal(300) * 2).astype(np.float32)
    args = {"logits": np.tile(row, (rows, 1)), "temperature": np.full(rows, 0.9, np.float32),
            "seeds": np.arange(rows, dtype=np.int64) * 7919 - 10**6, "top_k": np.full(rows, 40, np.int32),
            "top_p": np.full(rows, 0.8, np.float32), "min_p": np.full(rows, 0.02, np.float32)}
    got = run_sample(hal_backend, args)
    assert_same_tokens(got, args)
    kept = kept_weights(row, 0.9, 40, 0.8, 0.02)
    assert kept is not None and set(got.tolist()) <= set(np.flatnonzero(kept).tolist())


def test_sample_frequencies(hal_backend: Any) -> None:
    """4000 fixed seeds over one 12-token distribution: a chi-square statistic within its 0.9999 quantile."""
    rows, vocab = 4000, 12
    row = np.linspace(-1.5, 1.0, vocab).astype(np.float32)
    args = {"logits": np.tile(row, (rows, 1)), "temperature": np.full(rows, 1.0, np.float32),
            "seeds": np.arange(rows, dtype=np.int64) + 12345, "top_k": np.full(rows, 10, np.int32)}
    got = run_sample(hal_backend, args)
    weights = kept_weights(row, 1.0, 10, 1.0, 0.0)
    assert weights is not None
    expected = rows * weights / weights.sum()
    counts = np.bincount(got, minlength=vocab)
    assert counts[expected == 0].sum() == 0, f"tokens outside the top 10 drawn: {counts}"
    chi2 = float((((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum())
    assert chi2 < 33.7, f"chi-square {chi2:.1f} over 9 degrees of freedom (0.9999 quantile 33.7): {counts}"


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_sample_greedy_is_argmax(hal_backend: Any, hal_rng: np.random.Generator, dtype: str) -> None:
    """Temperature 0: the first index of the row's maximum, whatever top_k/top_p/min_p say."""
    args = sample_inputs(hal_rng, num_seqs=7, vocab_size=1001, dtype=dtype, greedy=True)
    args["logits"][3, [5, 700]] = 50.0  # a tie: the lower index wins
    got = run_sample(hal_backend, args)
    np.testing.assert_array_equal(got, np.argmax(args["logits"].astype(np.float64), axis=1))
    assert got[3] == 5


def test_sample_special_rows(hal_backend: Any) -> None:
    """NaN or only -inf: -1 (greedy too); -inf tokens never drawn; a +inf maximum draws among the +inf tokens."""
    vocab, rows = 9, 8
    logits = np.tile(np.arange(vocab, dtype=np.float32), (rows, 1))
    logits[0, 4] = np.nan
    logits[1] = -np.inf
    logits[2, :] = -np.inf
    logits[2, [1, 6]] = [0.0, 3.0]
    logits[3, [2, 7]] = np.inf
    logits[4, 3] = np.nan
    logits[5] = -np.inf
    temperature = np.array([1, 1, 1, 1, 0, 0, 1, 0], np.float32)
    args = {"logits": logits, "temperature": temperature, "seeds": np.arange(rows, dtype=np.int64)}
    got = run_sample(hal_backend, args)
    assert got[[0, 1, 4, 5]].tolist() == [-1, -1, -1, -1]
    assert got[2] in (1, 6) and got[3] in (2, 7) and got[7] == vocab - 1
    assert_same_tokens(got, args)
    seeds = np.arange(64, dtype=np.int64)
    many = {"logits": np.tile(logits[3], (64, 1)), "temperature": np.ones(64, np.float32), "seeds": seeds}
    assert set(run_sample(hal_backend, many).tolist()) == {2, 7}


def test_sample_out_and_empty(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """``out=`` receives the tokens; no sequences gives an empty int64 result."""
    args = sample_inputs(hal_rng, num_seqs=3, vocab_size=64, dtype="fp32")
    dev = to_backend(hal_backend, "sample", args)
    out = hal_backend.asarray(np.full(3, 99, np.int64))
    result = hal_backend.ops.sample(dev["logits"], dev["temperature"], dev["seeds"], top_k=dev["top_k"], out=out)
    assert result is out
    assert_same_tokens(np.asarray(hal_backend.to_numpy(out)), {**args, "top_p": None, "min_p": None})
    empty = sample_inputs(hal_rng, num_seqs=0, vocab_size=64, dtype="fp32")
    got = run_sample(hal_backend, empty)
    assert got.shape == (0,) and got.dtype == np.int64


def _bad(case: str, args: dict[str, Any]) -> None:
    n = args["logits"].shape[0]
    if case == "temperature-negative":
        args["temperature"][1] = -0.5
    elif case == "temperature-nan":
        args["temperature"][0] = np.nan
    elif case == "temperature-inf":
        args["temperature"][2] = np.inf
    elif case == "top_p-zero":
        args["top_p"][0] = 0.0
    elif case == "top_p-above-one":
        args["top_p"][1] = 1.5
    elif case == "min_p-negative":
        args["min_p"][2] = -0.1
    elif case == "min_p-nan":
        args["min_p"][0] = np.nan
    elif case == "temperature-dtype":
        args["temperature"] = args["temperature"].astype(np.float64)
    elif case == "seeds-dtype":
        args["seeds"] = args["seeds"].astype(np.int32)
    elif case == "top_k-dtype":
        args["top_k"] = args["top_k"].astype(np.int64)
    elif case == "top_p-shape":
        args["top_p"] = np.full(n + 1, 0.5, np.float32)
    elif case == "logits-rank":
        args["logits"] = args["logits"][0]
    elif case == "logits-dtype":
        args["logits"] = args["logits"].astype(np.float64)


BAD_INPUTS = [
    ("temperature-negative", ArgumentError, "temperature"),
    ("temperature-nan", ArgumentError, "temperature"),
    ("temperature-inf", ArgumentError, "temperature"),
    ("top_p-zero", ArgumentError, "top_p"),
    ("top_p-above-one", ArgumentError, "top_p"),
    ("min_p-negative", ArgumentError, "min_p"),
    ("min_p-nan", ArgumentError, "min_p"),
    ("temperature-dtype", ArgumentTypeError, "temperature"),
    ("seeds-dtype", ArgumentTypeError, "seeds"),
    ("top_k-dtype", ArgumentTypeError, "top_k"),
    ("top_p-shape", ArgumentError, "top_p"),
    ("logits-rank", ArgumentError, "logits"),
    ("logits-dtype", ArgumentTypeError, "logits"),
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_sample_rejects_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str, error: type,
                                  argument: str) -> None:
    """Bad values, dtypes and shapes of host arrays are refused at the call naming the argument, ``out`` untouched.

    (Device parameter values are checked by the kernels and reported at the next synchronisation.)
    """
    args = sample_inputs(hal_rng, num_seqs=3, vocab_size=50, dtype="fp32")
    _bad(case, args)
    out = np.full(3, 99, np.int64)
    with pytest.raises(error, match=f"'{argument}'"):
        hal_backend.ops.sample(args["logits"], args["temperature"], args["seeds"], top_k=args["top_k"],
                               top_p=args["top_p"], min_p=args["min_p"], out=out)
    np.testing.assert_array_equal(out, np.full(3, 99, np.int64))


def test_sample_rejects_wrong_out(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """An ``out`` that is not int64 ``[num_seqs]`` is refused naming ``out``."""
    args = sample_inputs(hal_rng, num_seqs=3, vocab_size=50, dtype="fp32")
    for out in (np.zeros(3, np.float32), np.zeros(4, np.int64), np.zeros(3, np.int32)):
        with pytest.raises((ArgumentError, ArgumentTypeError), match="'out'"):
            hal_backend.ops.sample(args["logits"], args["temperature"], args["seeds"], out=out)
