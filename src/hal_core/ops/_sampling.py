"""The float64 definition of ``sample``: the per-row uniform of a seed, the kept set, and the draw.

:mod:`hal_core.ops.sample` documents the semantics; the kernels of every backend follow these functions
step by step (in float32), so a seed gives the same token everywhere up to rounding at a CDF boundary.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["draw", "kept_weights", "sample_rows", "splitmix64", "uniform_of_seed"]

_MASK64 = (1 << 64) - 1


def splitmix64(seed: int) -> int:
    """splitmix64 of ``seed`` (taken modulo 2**64): the counter-based generator every backend uses."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_of_seed(seed: int) -> float:
    """The row's draw ``u`` in [0, 1): the top 53 bits of ``splitmix64(seed)`` over 2**53 (exact in float64)."""
    return (splitmix64(int(seed) & _MASK64) >> 11) * 2.0 ** -53


def kept_weights(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray | None:
    """The unnormalised probabilities of the kept tokens of one row (0 elsewhere), or None (no token).

    None for a row holding NaN or only -inf. ``temperature == 0``: the first maximum alone (weight 1).
    Otherwise ``w = exp((x - max) / temperature)`` (a row whose max is +inf: weight 1 on its +inf tokens,
    0 elsewhere), -inf tokens removed, then in this order: top-k (keep ``x >=`` the k-th largest value),
    top-p (keep a token when the kept mass strictly above its value is below ``top_p`` times the kept
    mass), min-p (keep ``w >= min_p``, the max having weight 1).
    """
    x = np.asarray(row, dtype=np.float64)
    vocab = x.size
    if np.isnan(x).any():
        return None
    top = x.max()
    if top == -math.inf:
        return None
    if temperature == 0.0:
        weights = np.zeros(vocab)
        weights[int(np.argmax(x))] = 1.0
        return weights
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        weights = (x == math.inf).astype(np.float64) if top == math.inf else np.exp((x - top) / temperature)
    keep = x > -math.inf if top < math.inf else x == math.inf
    if 0 < top_k < vocab:
        kth = np.partition(x, vocab - top_k)[vocab - top_k]
        keep &= x >= kth
    if top_p < 1.0:
        kept = np.where(keep, weights, 0.0)
        order = np.argsort(-x, kind="stable")
        values, masses = x[order], kept[order]
        before = np.concatenate([[0.0], np.cumsum(masses)[:-1]])  # mass of the tokens placed before, in order
        first = np.searchsorted(-values, -values, side="left")  # the first token of each run of equal values
        above = np.empty(vocab)
        above[order] = before[first]  # mass strictly above each token's value
        keep &= above < top_p * kept.sum()
    if min_p > 0.0:
        keep &= weights >= min_p
    return np.where(keep, weights, 0.0)


def draw(weights: np.ndarray, u: float) -> int:
    """The kept token whose CDF interval (in index order) holds ``u`` times the kept mass."""
    cdf = np.cumsum(weights)
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if token >= weights.size:  # rounding at the end of the CDF: the last kept token
        token = int(np.flatnonzero(weights)[-1])
    return token


def sample_rows(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray | None, top_p: np.ndarray | None,
                min_p: np.ndarray | None, seeds: np.ndarray) -> np.ndarray:
    """The token of each row (int64; -1 for a row holding NaN or only -inf), in float64."""
    rows = logits.shape[0]
    out = np.full(rows, -1, dtype=np.int64)
    for r in range(rows):  # the reference: one row at a time, as written in the op's documentation
        weights = kept_weights(logits[r], float(temperature[r]), int(top_k[r]) if top_k is not None else 0,
                               float(top_p[r]) if top_p is not None else 1.0,
                               float(min_p[r]) if min_p is not None else 0.0)
        if weights is not None:
            out[r] = draw(weights, uniform_of_seed(int(seeds[r])))
    return out
