"""The variable-length paged-attention kernel against a float64 reference: prompts, chunks and decode rows mixed,
sliding window, softcap, sinks, ALiBi, strided caches, every ISA variant, AMX on and off."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hal_cpu import _abi, _native
from hal_cpu.ops import _fallback_attention, _rules, paged_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from hal_core.arrays import BFLOAT16
from hal_core.testing.inputs import assert_close

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": BFLOAT16}
HEADS = [(4, 4), (8, 2), (9, 3), (32, 8)]
#: (new tokens, context length) per sequence: decode rows only, prompts only, and a mixed step
#: (chunks at an offset, decode rows, an empty-context-free prompt of one block plus one token).
BATCHES = {
    "decode": [(1, 1), (1, 37), (1, 300), (1, 16)],
    "prefill": [(70, 70), (17, 17), (33, 33)],
    "mixed": [(1, 90), (40, 140), (1, 5), (17, 17), (3, 64), (1, 200)],
}


def inputs(rng: np.random.Generator, batch: list[tuple[int, int]], heads: tuple[int, int], head_size: int,
           block_size: int, dtype: str, *, interleaved: bool = False) -> dict[str, Any]:
    """A paged cache in random blocks, NaN in every slot no used token occupies, garbage past each table's end."""
    num_heads, num_kv_heads = heads
    dt = DTYPES[dtype]
    q_lens, lens = [q for q, _ in batch], [n for _, n in batch]
    used_blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(used_blocks) + 2
    order = rng.permutation(num_blocks).astype(np.int32)
    table = np.full((len(batch), max(used_blocks) + 2), num_blocks + 1000, dtype=np.int32)
    first = 0
    for s, n in enumerate(used_blocks):
        table[s, :n] = order[first:first + n]
        first += n
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    if interleaved:  # vLLM's CPU layout: one [blocks, kv_heads, block_size, 2 * head_size] tensor, split in halves
        fused = rng.standard_normal((num_blocks, num_kv_heads, 2 * block_size, head_size)).astype(dt)
        key_cache, value_cache = fused[:, :, :block_size], fused[:, :, block_size:]
    else:
        key_cache, value_cache = (rng.standard_normal(shape).astype(dt) for _ in range(2))
    used = np.zeros((num_blocks, block_size), dtype=bool)
    for s, n in enumerate(lens):
        t = np.arange(n)
        used[table[s, t // block_size], t % block_size] = True
    for cache in (key_cache, value_cache):
        cache.transpose(0, 2, 1, 3)[~used] = np.nan
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(starts[-1]), num_heads, head_size)).astype(dt)
    return {"query": query, "key_cache": key_cache, "value_cache": value_cache, "block_tables": table,
            "seq_lens": np.array(lens, dtype=np.int32), "query_start_loc": starts,
            "scale": float(head_size ** -0.5)}


def reference(args: dict[str, Any], *, window: int | None = None, softcap: float | None = None,
              sinks: np.ndarray | None = None, alibi_slopes: np.ndarray | None = None) -> np.ndarray:
    """The contract in float64, row by row of each sequence (decode rows of an empty sequence: zeros)."""
    query = args["query"].astype(np.float64)
    num_tokens, num_heads, head_size = query.shape
    kv = args["key_cache"].shape[1]
    group, block_size = num_heads // kv, args["key_cache"].shape[2]
    starts = args.get("query_start_loc")
    starts = np.arange(len(args["seq_lens"]) + 1) if starts is None else starts
    out = np.zeros((num_tokens, num_heads, head_size))
    for s, length in enumerate(args["seq_lens"]):
        r0, r1 = int(starts[s]), int(starts[s + 1])
        if r1 == r0 or length == 0:
            continue
        t = np.arange(length)
        blocks = args["block_tables"][s, t // block_size]
        keys = args["key_cache"][blocks, :, t % block_size].astype(np.float64)  # [L, kv, d]
        values = args["value_cache"][blocks, :, t % block_size].astype(np.float64)
        for i in range(r1 - r0):
            p = length - (r1 - r0) + i
            seen = np.arange(max(0, p - window + 1) if window else 0, p + 1)
            for h in range(num_heads):
                x = args["scale"] * (keys[seen, h // group] @ query[r0 + i, h])
                if softcap:
                    x = softcap * np.tanh(x / softcap)
                if alibi_slopes is not None:
                    x = x + float(alibi_slopes[h]) * (seen - p)
                logits = x if sinks is None else np.append(x, float(sinks[h]))
                with np.errstate(invalid="ignore"):
                    e = np.exp(logits - logits.max())
                    out[r0 + i, h] = (e[:seen.size] @ values[seen, h // group]) / e.sum()
    return out


def attend(args: dict[str, Any], **kwargs: Any) -> np.ndarray:
    """The wrapper on ``args`` (float32 output unless asked otherwise)."""
    kwargs.setdefault("out_dtype", np.float32)
    keys = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
    return paged_attention.attend(*(args[k] for k in keys), args["scale"],
                                  query_start_loc=args.get("query_start_loc"), **kwargs)


@pytest.fixture(params=["amx", "fma"])
def amx(request: pytest.FixtureRequest, native: _native.Native) -> Iterator[str]:
    """bf16/fp16 prompts on AMX tiles (where the CPU has them) and on vector FMAs."""
    if request.param == "amx" and not native.lib.hal_cpu_attention_amx():
        pytest.skip(f"AMX does not run under the {native.lib.hal_cpu_isa().decode()} variant on this CPU/OS "
                    "(or HAL_CPU_AMX=0): the FMA path is the one that runs")
    previous = native.lib.hal_cpu_set_attention_amx(int(request.param == "amx"))
    try:
        yield request.param
    finally:
        native.lib.hal_cpu_set_attention_amx(previous)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}-{k}" for h, k in HEADS])
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
def test_batches_match_reference(variant: str, amx: str, rng: np.random.Generator, batch: str,
                                 heads: tuple[int, int], dtype: str) -> None:
    """Decode-only, prefill-only and mixed batches, every GQA shape, with and without split-KV."""
    if amx == "amx" and (dtype == "fp32" or variant in ("avx2", "baseline")):
        pytest.skip("AMX serves bf16/fp16 in the AVX-512 variants only")
    args = inputs(rng, BATCHES[batch], heads, 64, 16, dtype)
    expected = reference(args)
    for partition_tokens in (0, 32):
        got = attend(args, partition_tokens=partition_tokens, query_tile=5, threads=2)
        assert_close(got, expected, kind="attention", dtype=dtype,
                     what=f"{variant}/{amx} {batch} split={partition_tokens}")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_head_and_block_sizes(variant: str, rng: np.random.Generator, head_size: int, block_size: int,
                              dtype: str) -> None:
    """Head sizes with and without an AMX/vector tail; contexts crossing block boundaries; interleaved K/V views."""
    args = inputs(rng, [(20, 150), (1, 33), (9, 9)], (8, 2), head_size, block_size, dtype,
                  interleaved=block_size == 32)
    assert_close(attend(args), reference(args), kind="attention", dtype=dtype, what=f"{variant} d={head_size}")


OPTIONS = {
    "window": {"window": 7},
    "window-wide": {"window": 100},
    "softcap": {"softcap": 2.5},
    "sinks": {"sinks": "random"},
    "alibi": {"alibi_slopes": "random"},
    "all": {"window": 23, "softcap": 4.0, "sinks": "random", "alibi_slopes": "random"},
}


def _options(rng: np.random.Generator, name: str, num_heads: int) -> dict[str, Any]:
    options = dict(OPTIONS[name])
    if options.get("sinks") == "random":
        options["sinks"] = (2 * rng.standard_normal(num_heads)).astype(np.float32)
    if options.get("alibi_slopes") == "random":
        options["alibi_slopes"] = (0.3 * rng.random(num_heads)).astype(np.float32)
    return options


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_reference(variant: str, amx: str, rng: np.random.Generator, option: str, dtype: str) -> None:
    """Sliding window, softcap, sinks, ALiBi (alone and together) on decode rows, chunks and prompts, split or not."""
    if amx == "amx" and (dtype == "fp32" or variant in ("avx2", "baseline")):
        pytest.skip("AMX serves bf16/fp16 in the AVX-512 variants only")
    args = inputs(rng, BATCHES["mixed"] + [(130, 130)], (8, 2), 64, 16, dtype)
    options = _options(rng, option, 8)
    expected = reference(args, **options)
    for partition_tokens in (0, 48):
        got = attend(args, partition_tokens=partition_tokens, **options)
        assert_close(got, expected, kind="attention", dtype=dtype, what=f"{variant}/{amx} {option}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_out_dtype_is_written_by_the_kernel(rng: np.random.Generator, dtype: str) -> None:
    """The kernel writes the query's dtype itself: the float32 result rounded to nearest even, bit for bit."""
    args = inputs(rng, BATCHES["mixed"], (8, 2), 64, 16, dtype)
    wide = attend(args)
    own = attend(args, out_dtype=None)
    np.testing.assert_array_equal(own.view(np.uint8), wide.astype(DTYPES[dtype]).view(np.uint8))


def test_decode_rows_with_and_without_query_start_loc(rng: np.random.Generator) -> None:
    """One new token per sequence given as query_start_loc is the decode call, bit for bit (empty sequences: 0)."""
    args = inputs(rng, BATCHES["decode"], (8, 2), 64, 16, "fp16")
    decode = attend(dict(args, query_start_loc=None))
    np.testing.assert_array_equal(attend(args), decode)
    empty = dict(args, seq_lens=np.array([0, 37, 0, 16], dtype=np.int32), query_start_loc=None)
    got = attend(empty)
    assert not got[[0, 2]].any()
    assert_close(got, reference(empty), kind="attention", dtype="fp16")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(rng: np.random.Generator, threads: int) -> None:
    """Tasks are independent and merges run in a fixed order: the bits do not depend on the thread count."""
    args = inputs(rng, BATCHES["mixed"], (8, 2), 64, 16, "bf16")
    serial = attend(args, partition_tokens=64, threads=1)
    np.testing.assert_array_equal(attend(args, partition_tokens=64, threads=threads), serial)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("what", "value"), [("value", np.inf), ("value", np.nan), ("key", np.nan), ("key", np.inf)])
def test_non_finite_cache_values_reach_only_the_rows_that_see_them(amx: str, rng: np.random.Generator, what: str,
                                                                  value: float, dtype: str) -> None:
    """A non-finite K/V row reaches exactly the rows whose window holds it, as in the reference (never 0 * inf)."""
    if amx == "amx" and dtype == "fp32":
        pytest.skip("AMX serves bf16/fp16 only")
    args = inputs(rng, [(60, 80)], (4, 2), 64, 16, dtype)
    token = 50  # seen by the prompt's rows at positions >= 50 (rows 30..59), hidden from the earlier ones
    block = args["block_tables"][0, token // 16]
    args["key_cache" if what == "key" else "value_cache"][block, 0, token % 16, 3] = value
    expected = reference(args, window=25)
    assert not np.isfinite(expected).all() and np.isfinite(expected[:30]).all()
    got = attend(args, window=25)
    assert_close(got, expected, kind="attention", dtype=dtype, what=f"{amx} {what}={value}")


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_batches(data: st.DataObject) -> None:
    """Random batches of decode rows, chunks and prompts with random options match the reference."""
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    heads = data.draw(st.sampled_from(HEADS), label="heads")
    dtype = data.draw(st.sampled_from(list(DTYPES)), label="dtype")
    batch = data.draw(st.lists(st.integers(1, 90).flatmap(lambda n: st.tuples(st.integers(1, n), st.just(n))),
                               min_size=1, max_size=5), label="batch")
    args = inputs(rng, batch, heads, data.draw(st.sampled_from([32, 64, 80]), label="head_size"),
                  data.draw(st.sampled_from([8, 16, 32]), label="block_size"), dtype)
    options = {}
    if data.draw(st.booleans(), label="window"):
        options["window"] = data.draw(st.integers(1, 100))
    if data.draw(st.booleans(), label="softcap"):
        options["softcap"] = data.draw(st.floats(0.5, 30.0))
    if data.draw(st.booleans(), label="sinks"):
        options["sinks"] = rng.standard_normal(heads[0]).astype(np.float32)
    if data.draw(st.booleans(), label="alibi"):
        options["alibi_slopes"] = (0.5 * rng.random(heads[0])).astype(np.float32)
    knobs = {"query_tile": data.draw(st.integers(1, 40), label="query_tile"),
             "partition_tokens": data.draw(st.sampled_from([0, 16, 64]), label="partition_tokens")}
    assert_close(attend(args, **options, **knobs), reference(args, **options), kind="attention", dtype=dtype,
                 what=f"seed {seed}")


@pytest.mark.parametrize("option", ["none", "all"])
def test_numpy_fallback(rng: np.random.Generator, option: str) -> None:
    """The numpy fallback (no compiled library) serves the whole contract too."""
    args = inputs(rng, BATCHES["mixed"], (9, 3), 64, 16, "fp16")
    options = {} if option == "none" else _options(rng, "all", 9)
    keys = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
    got = _fallback_attention.attend(*(args[k] for k in keys), args["scale"],
                                     query_start_loc=args["query_start_loc"], **options)
    assert_close(got, reference(args, **options), kind="attention", dtype="fp16", what="fallback")


def test_stale_library_is_refused(native: _native.Native) -> None:
    """A mirror that disagrees with the compiled struct is a clear NativeUnavailable, never a call with garbage."""
    _native.check_abi(native.lib)  # the real mirror matches

    class Stale(ctypes.Structure):
        _fields_ = [*_abi.AttentionArgs._fields_[:-2], ("threads", ctypes.c_int32)]  # query_tile dropped

    with pytest.raises(_native.NativeUnavailable, match=r"rebuild with `pip install -e plugins/hal_cpu`"):
        _native.check_abi(native.lib, {"attention": Stale})
    assert "query_tile" in (_abi.mismatch("attention", Stale, native.lib.hal_cpu_abi(b"attention").decode()) or "")


@pytest.mark.parametrize(("heads", "expected"), [((32, 8), 32), ((4, 4), 128), ((256, 1), 1), ((9, 3), 42)])
def test_query_tile_rule(heads: tuple[int, int], expected: int) -> None:
    """A prefill task holds about ATTENTION_TILE_ROWS rows: tokens times the GQA group."""
    assert _rules.attention_query_tile(*heads) == expected
