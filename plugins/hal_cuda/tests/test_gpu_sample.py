"""``sample`` on a GPU: the reference's tokens for every dtype, odd and large vocabularies, strided rows, greedy
rows, the same tokens on every launch, and device parameter errors at the next synchronisation.

Skipped (lazily, with the probe's reason) where no CUDA device is usable. ``HAL_STRICT=1`` is set, so a call that
would fall back to the CPU path fails instead of passing on the CPU's result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core.testing.inputs import sample_inputs
from hal_core.testing.sampling import assert_same_tokens


@pytest.fixture
def be(cuda_backend: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HAL_STRICT", "1")
    return cuda_backend


def _on_device(be: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {name: be.asarray(value) for name, value in args.items() if value is not None}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("vocab", [1, 7, 32000, 151936])
def test_sample_matches_reference(be: Any, rng: np.random.Generator, dtype: str, vocab: int) -> None:
    """Mixed greedy and filtered rows: each row's token is the reference's for its seed, launch after launch."""
    args = sample_inputs(rng, num_seqs=16, vocab_size=vocab, dtype=dtype)
    dev = _on_device(be, args)
    first = be.to_numpy(be.ops.sample(**dev))
    assert_same_tokens(first, args)
    np.testing.assert_array_equal(be.to_numpy(be.ops.sample(**dev)), first)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_sample_strided_device_rows(be: Any, rng: np.random.Generator, dtype: str) -> None:
    """Every other row of a wider device array, read in place: the reference's tokens."""
    args = sample_inputs(rng, num_seqs=8, vocab_size=50000, dtype=dtype, strided=True)
    dev = _on_device(be, {**args, "logits": None})
    full = be.asarray(np.ascontiguousarray(args["logits"].base))
    got = be.to_numpy(be.ops.sample(full[::2, :50000], **dev))
    assert_same_tokens(got, args)


def test_sample_many_seeds_of_one_row(be: Any, rng: np.random.Generator) -> None:
    """2048 seeds over one 128256-token distribution with every filter on: each draw is the reference's."""
    rows = 2048
    row = (rng.standard_normal(128256) * 3).astype(np.float32)
    args = {"logits": np.tile(row, (rows, 1)), "temperature": np.full(rows, 0.8, np.float32),
            "seeds": np.arange(rows, dtype=np.int64), "top_k": np.full(rows, 50, np.int32),
            "top_p": np.full(rows, 0.9, np.float32), "min_p": np.full(rows, 0.05, np.float32)}
    assert_same_tokens(be.to_numpy(be.ops.sample(**_on_device(be, args))), args)


def test_sample_bad_device_parameter_is_raised_at_synchronisation(be: Any, rng: np.random.Generator) -> None:
    """A device top_p of 0: that row is -1 and check_errors names 'top_p'."""
    args = sample_inputs(rng, num_seqs=4, vocab_size=1000, dtype="fp32")
    args["top_p"][1] = 0.0
    got = be.to_numpy(be.ops.sample(**_on_device(be, args)))
    assert got[1] == -1
    with pytest.raises(hal_core.ArgumentError, match="'top_p'"):
        hal_core.check_errors()
