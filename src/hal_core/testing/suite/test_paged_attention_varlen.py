"""paged_attention on packed batches mixing prompts, prompt chunks and decodes, with every variant, against float64.

The grid follows what engines run: decode-only, prefill-only and mixed batches; GQA ratios (4,4),
(8,2), (9,3), (32,8); head sizes 64 to 256; block sizes 16, 32 and 128; sliding windows, logit softcap,
attention sinks and ALiBi; caches as strided views (an engine's interleaved K/V halves); random block
tables and contexts crossing block boundaries. A backend that leaves a variant to the fallback
declares it (``OpCoverage(variants=...)``); the results must be right either way. The options go in as
one :class:`~hal_core.AttentionOptions` of the backend's arrays (as an engine passes a layer's), except in
:func:`test_varlen_writes_out`, which passes them as flat keywords.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hal_core.ops import OPS, AttentionOptions
from hal_core.testing.inputs import assert_close, paged_attention_inputs, to_backend
from hal_core.testing.suite._strategies import DTYPES, OP_SETTINGS, seeds

REFERENCE = OPS["paged_attention"].reference
_ARRAYS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
_OPTIONS = OPS["paged_attention"].options.names  # type: ignore[union-attr]


def _split(dev: dict[str, Any]) -> tuple[AttentionOptions, dict[str, Any]]:
    """The layer's options as one value, and the other keywords."""
    options = AttentionOptions(**{name: dev[name] for name in _OPTIONS if name in dev})
    return options, {name: dev[name] for name in dev if name not in _ARRAYS and name not in _OPTIONS}


def _run(backend: Any, args: dict[str, Any], **replace: Any) -> np.ndarray:
    """The op on ``args`` moved to the backend (``replace``: device arrays to use instead)."""
    dev = {**to_backend(backend, "paged_attention", args), **replace}
    options, keywords = _split(dev)
    return backend.to_numpy(backend.ops.paged_attention(*(dev[name] for name in _ARRAYS), options=options,
                                                        **keywords))


def test_varlen_calls_receive_the_options_whole(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """The call the backend's implementations receive carries the caller's AttentionOptions object itself."""
    args = paged_attention_inputs(hal_rng, seq_lens=[30, 4], num_heads=4, num_kv_heads=2, head_size=64,
                                  block_size=16, dtype="fp32", query_lens=[10, 4])
    args = _with_variants(hal_rng, args, {"window", "softcap", "sinks", "alibi"})
    dev = to_backend(hal_backend, "paged_attention", args)
    options, keywords = _split(dev)
    call = hal_backend.ops.prepare("paged_attention", **{name: dev[name] for name in _ARRAYS}, **keywords,
                                   options=options)
    assert call.options is options
    assert all(call.args[name] is getattr(options, name) for name in ("sinks", "alibi_slopes"))


def _with_variants(rng: np.random.Generator, args: dict[str, Any], variants: set[str]) -> dict[str, Any]:
    heads = args["query"].shape[1]
    if "window" in variants:
        args["window"] = int(rng.integers(1, 40))
    if "softcap" in variants:
        args["softcap"] = float(rng.uniform(1.0, 30.0))
    if "sinks" in variants:
        args["sinks"] = (rng.standard_normal(heads) * 2).astype(np.float32)
    if "alibi" in variants:
        args["alibi_slopes"] = (2.0 ** -rng.uniform(0, 8, heads)).astype(np.float32)
    return args


#: (name, context lengths, new tokens per sequence): each kind of step an engine schedules.
BATCHES = [
    ("decode", [37, 1, 130], [1, 1, 1]),
    ("prefill", [45, 17], [45, 17]),
    ("chunked", [96, 40], [32, 7]),
    ("mixed", [70, 33, 1, 129, 0], [70, 5, 1, 1, 0]),
]
HEADS = [(4, 4), (8, 2), (9, 3), (32, 8)]
VARIANTS = [set(), {"window"}, {"softcap"}, {"sinks"}, {"alibi"}, {"window", "softcap", "sinks"}]


@pytest.mark.parametrize("variants", VARIANTS, ids=lambda v: "+".join(sorted(v)) or "plain")
@pytest.mark.parametrize(("kind", "lens", "q_lens"), BATCHES, ids=[b[0] for b in BATCHES])
def test_varlen_batches_and_variants(hal_backend: Any, hal_rng: np.random.Generator, kind: str, lens: list[int],
                                     q_lens: list[int], variants: set[str]) -> None:
    """Every kind of step with every variant, GQA 8/2, head 64, block 16, fp32."""
    args = paged_attention_inputs(hal_rng, seq_lens=lens, num_heads=8, num_kv_heads=2, head_size=64,
                                  block_size=16, dtype="fp32", query_lens=q_lens)
    args = _with_variants(hal_rng, args, variants)
    assert_close(_run(hal_backend, args), REFERENCE(args), kind="attention", dtype="fp32", what=kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS, ids=[f"h{h}-kv{k}" for h, k in HEADS])
def test_varlen_heads_and_dtypes(hal_backend: Any, hal_rng: np.random.Generator, heads: int, kv_heads: int,
                                 dtype: str) -> None:
    """GQA/MQA groups of every shape, each dtype, on a mixed batch."""
    args = paged_attention_inputs(hal_rng, seq_lens=[50, 9, 1], num_heads=heads, num_kv_heads=kv_heads,
                                  head_size=128, block_size=16, dtype=dtype, query_lens=[20, 9, 1])
    assert_close(_run(hal_backend, args), REFERENCE(args), kind="attention", dtype=dtype)


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_varlen_head_and_block_sizes(hal_backend: Any, hal_rng: np.random.Generator, head_size: int,
                                     block_size: int) -> None:
    """Head sizes 64-256 and block sizes 16-128, contexts crossing block boundaries, with a window."""
    args = paged_attention_inputs(hal_rng, seq_lens=[2 * block_size + 3, 5], num_heads=4, num_kv_heads=2,
                                  head_size=head_size, block_size=block_size, dtype="bf16",
                                  query_lens=[block_size + 1, 2])
    args["window"] = block_size + 2
    assert_close(_run(hal_backend, args), REFERENCE(args), kind="attention", dtype="bf16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_on_interleaved_cache_halves(hal_backend: Any, hal_rng: np.random.Generator, dtype: str) -> None:
    """K and V as the two halves of one [blocks, kv_heads, 2 * block, head] cache (an engine's own layout)."""
    args = paged_attention_inputs(hal_rng, seq_lens=[40, 3], num_heads=8, num_kv_heads=2, head_size=64,
                                  block_size=32, dtype=dtype, query_lens=[12, 1])
    both = hal_backend.asarray(np.concatenate([args["key_cache"], args["value_cache"]], axis=2))
    block = args["key_cache"].shape[2]
    got = _run(hal_backend, args, key_cache=both[:, :, :block], value_cache=both[:, :, block:])
    assert_close(got, REFERENCE(args), kind="attention", dtype=dtype)


def test_varlen_writes_out(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """With out=, a packed result lands in out and out is returned."""
    args = paged_attention_inputs(hal_rng, seq_lens=[30, 4], num_heads=4, num_kv_heads=1, head_size=64,
                                  block_size=16, dtype="fp16", query_lens=[10, 4])
    out = hal_backend.asarray(np.full(args["query"].shape, np.nan, np.float16))
    dev = to_backend(hal_backend, "paged_attention", args)
    result = hal_backend.ops.paged_attention(*(dev[name] for name in _ARRAYS), scale=args["scale"], out=out,
                                             query_start_loc=dev["query_start_loc"],
                                             max_query_len=args["max_query_len"])
    assert result is out
    assert_close(hal_backend.to_numpy(out), REFERENCE(args), kind="attention", dtype="fp16")


@OP_SETTINGS
@given(seed=seeds, data=st.data())
def test_varlen_random_batches(hal_backend: Any, seed: int, data: st.DataObject) -> None:
    """Random packed batches, heads, head and block sizes and variants match float64."""
    rng = np.random.default_rng(seed)
    lens = data.draw(st.lists(st.integers(0, 200), min_size=1, max_size=5))
    q_lens = [data.draw(st.integers(0, min(n, 64))) for n in lens]
    kv_heads = data.draw(st.sampled_from([1, 2, 3]))
    ratio = data.draw(st.sampled_from([1, 3, 4]))
    head_size = data.draw(st.sampled_from([64, 96, 128]))
    block_size = data.draw(st.sampled_from([16, 32, 128]))
    dtype = data.draw(st.sampled_from(DTYPES))
    variants = data.draw(st.sets(st.sampled_from(["window", "softcap", "sinks", "alibi"])))
    args = paged_attention_inputs(rng, seq_lens=lens, num_heads=kv_heads * ratio, num_kv_heads=kv_heads,
                                  head_size=head_size, block_size=block_size, dtype=dtype, query_lens=q_lens)
    args = _with_variants(rng, args, variants)
    assert_close(_run(hal_backend, args), REFERENCE(args), kind="attention", dtype=dtype)
