"""rotary_embedding's declaration: signature, bench presets, cost counts, and the exact overlap check of two views."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hal_core import bench
from hal_core.ops import OPS
from hal_core.ops._overlap import _meet
from hal_core.testing.inputs import rotary_embedding_inputs

SPEC = OPS["rotary_embedding"]


def test_signature_keeps_key_and_style_keyword_only() -> None:
    """positions, query and cos_sin_cache are positional; key and style are keyword-only, default None."""
    text = str(SPEC.signature())
    assert text == "(self, positions, query, cos_sin_cache, *, key=None, style=None)"
    assert SPEC.inplace_args == ("query", "key")


def test_bench_presets_hold_the_documented_shapes() -> None:
    """decode: 1 and 8 tokens, prefill: 512 tokens; 32 heads / 8 kv heads, head 128, fp32 and bf16."""
    for preset, tokens in (("decode", (1, 8)), ("prefill", (512,))):
        cases = bench.preset_cases(preset, ["rotary_embedding"])
        for t in tokens:
            for dtype in ("fp32", "bf16"):
                assert bench.make_case("rotary_embedding", tokens=t, dtype=dtype, heads=32, kv_heads=8,
                                       head=128) in cases
    case = bench.make_case("rotary_embedding", tokens=512, dtype="bf16")
    args = SPEC.bench.inputs(np.random.default_rng(0), case.params)
    SPEC.validate(dict(args), np.asarray)
    assert not args["query"].flags.c_contiguous  # the bench rotates slices of a fused projection


def test_cost_counts() -> None:
    """flops: six per rotated pair; bytes: the rotated part read and written, a table row and a position per token."""
    args = rotary_embedding_inputs(np.random.default_rng(1), num_tokens=3, num_heads=4, num_kv_heads=2,
                                   head_size=64, dtype="bf16", rotary_dim=32)
    rows = 3 * (4 + 2)
    assert SPEC.flops(args) == rows * 16 * 6
    assert SPEC.nbytes(args) == 2 * rows * 32 * 2 + 3 * 32 * 4 + 3 * args["positions"].itemsize
    assert SPEC.flops(dict(args, key=None)) == 3 * 4 * 16 * 6
    assert SPEC.bucket(args) == "bf16:t4"


def _brute(delta: int, shape_a: tuple[int, ...], shape_b: tuple[int, ...], strides: tuple[int, ...],
           itemsize: int) -> bool:
    """Whether any element of a (at byte 0) and b (at byte ``delta``) share a byte, by listing them."""
    def offsets(shape: tuple[int, ...]) -> set[int]:
        return {sum(i * s for i, s in zip(index, strides, strict=True)) for index in itertools.product(
            *(range(n) for n in shape))}

    a = {o + byte for o in offsets(shape_a) for byte in range(itemsize)}
    return any(delta + o + byte in a for o in offsets(shape_b) for byte in range(itemsize))


def test_overlap_search_matches_brute_force() -> None:
    """The dimension-by-dimension search agrees with listing every element, on random shapes, strides, offsets."""
    rng = np.random.default_rng(1234)
    print("seed=1234")
    for _ in range(400):
        ndim = int(rng.integers(1, 4))
        itemsize = int(rng.choice([2, 4]))
        strides = tuple(int(rng.integers(-6, 7)) * itemsize for _ in range(ndim))
        shape_a = tuple(int(rng.integers(1, 5)) for _ in range(ndim))
        shape_b = tuple(int(rng.integers(1, 5)) for _ in range(ndim))
        delta = int(rng.integers(-40, 41))
        assert _meet(delta, shape_a, shape_b, strides, itemsize) == _brute(delta, shape_a, shape_b, strides,
                                                                           itemsize), (delta, shape_a, shape_b,
                                                                                       strides, itemsize)


@pytest.mark.parametrize(("q", "k", "overlap"), [((0, 32), (32, 40), False), ((8, 40), (0, 8), False),
                                                 ((0, 32), (31, 39), True), ((0, 48, 2), (1, 17, 2), False)])
def test_views_of_one_projection(q: tuple[int, ...], k: tuple[int, ...], overlap: bool) -> None:
    """Head ranges of one [tokens, 48, 128] buffer: adjacent ranges are disjoint, a shared head is not."""
    from hal_core import ArgumentError
    from hal_core.ops._overlap import check_views_disjoint

    qkv = np.zeros((7, 48, 128), np.float16)
    query, key = qkv[:, slice(*q)], qkv[:, slice(*k)]
    if overlap:
        with pytest.raises(ArgumentError, match="'query' and 'key' overlap"):
            check_views_disjoint("query", query, "key", key)
    else:
        check_views_disjoint("query", query, "key", key)
