"""The float64 definition of ``sample`` against transformers' logits warpers and splitmix64's known values."""

from __future__ import annotations

import numpy as np
import pytest

from hal_core.ops._sampling import draw, kept_weights, splitmix64, uniform_of_seed

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")


def _transformers_kept(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The tokens transformers' warpers leave finite, applied in its generation order, in float64."""
    scores = torch.tensor(row, dtype=torch.float64)[None]
    warpers = [logits_process.TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(logits_process.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(logits_process.TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(logits_process.MinPLogitsWarper(min_p))
    for warper in warpers:
        scores = warper(None, scores)
    return (scores[0] > -float("inf")).numpy()


def test_kept_set_matches_transformers() -> None:
    """400 random rows and parameter sets (seed 20261204): the kept set is transformers' exactly."""
    rng = np.random.default_rng(20261204)
    for _ in range(400):
        vocab = int(rng.integers(1, 400))
        row = rng.standard_normal(vocab) * rng.uniform(0.5, 5.0)
        row[rng.random(vocab) < 0.05] = -np.inf
        row[0] = 0.0  # at least one finite token
        params = (float(rng.uniform(0.2, 2.0)), int(rng.integers(0, vocab + 2)),
                  float(rng.choice([1.0, rng.uniform(0.05, 1.0)])), float(rng.choice([0.0, rng.uniform(0.0, 0.5)])))
        weights = kept_weights(row, *params)
        assert weights is not None
        np.testing.assert_array_equal(weights > 0, _transformers_kept(row, *params), err_msg=f"{params}")


def test_top_k_keeps_ties_as_transformers() -> None:
    """Logits tied with the k-th largest are all kept, as transformers' top-k keeps them."""
    row = np.array([1.0, 3.0, 2.0, 2.0, 0.5, 2.0])
    weights = kept_weights(row, 1.0, 2, 1.0, 0.0)
    assert weights is not None
    np.testing.assert_array_equal(weights > 0, [False, True, True, True, False, True])
    np.testing.assert_array_equal(weights > 0, _transformers_kept(row, 1.0, 2, 1.0, 0.0))


def test_top_p_keeps_the_tie_of_the_last_token() -> None:
    """top-p: a token tied with the last one needed to reach the mass is kept too."""
    row = np.log(np.array([0.4, 0.2, 0.2, 0.1, 0.1]))
    weights = kept_weights(row, 1.0, 0, 0.5, 0.0)
    assert weights is not None
    np.testing.assert_array_equal(weights > 0, [True, True, True, False, False])


def test_splitmix64_known_values() -> None:
    """splitmix64 of 0 and 1 are the published first outputs of the generator seeded with 0 and 1."""
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(1) == 0x910A2DEC89025CC1
    assert uniform_of_seed(0) == (0xE220A8397B1DCDAF >> 11) / 2.0**53
    assert uniform_of_seed(-1) == (splitmix64(2**64 - 1) >> 11) / 2.0**53


def test_draw_walks_the_cdf_in_index_order() -> None:
    """The drawn token's CDF interval holds u times the mass; zero-weight tokens are never drawn."""
    weights = np.array([0.0, 1.0, 0.0, 3.0, 0.0])
    assert [draw(weights, u) for u in (0.0, 0.2499, 0.25, 0.9999999)] == [1, 1, 3, 3]
