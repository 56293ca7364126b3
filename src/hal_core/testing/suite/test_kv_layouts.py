"""write_kv_cache with the layouts engines pass: strided K/V views in, and caches that must be safe to write."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from hal_core import ArgumentError
from hal_core.arrays import is_c_contiguous
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, write_kv_cache_inputs
from hal_core.testing.suite._strategies import DTYPES

REFERENCE = OPS["write_kv_cache"].reference
NUM_TOKENS, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE = 24, 4, 2, 8, 64


def _rng(hal_seed: int, test: str) -> np.random.Generator:
    stream = zlib.crc32(test.encode())
    print(f"hal seed: --hal-seed={hal_seed} (test stream {stream})")
    return np.random.default_rng([hal_seed, stream])


def _inputs(rng: np.random.Generator, dtype: str) -> dict[str, Any]:
    return write_kv_cache_inputs(rng, num_tokens=NUM_TOKENS, num_blocks=NUM_BLOCKS, num_kv_heads=NUM_KV_HEADS,
                                 block_size=BLOCK_SIZE, head_size=HEAD_SIZE, dtype=dtype)


def _views(backend: Any, args: dict[str, Any], layout: str) -> tuple[Any, Any]:
    """``key`` and ``value`` as strided views of one array in the backend's domain."""
    key, value = args["key"], args["value"]
    if layout == "fused-qkv":  # [T, 3, H, D]: q, k, v of a fused projection; k = qkv[:, 1]
        qkv = np.stack([np.zeros_like(key), key, value], axis=1)
        dev = backend.asarray(qkv)
        return dev[:, 1], dev[:, 2]
    if layout == "padded-heads":  # [T, H, 2 * D][..., :D]: rows contiguous, heads strided
        padded = np.concatenate([np.stack([key, value]), np.zeros_like(np.stack([key, value]))], axis=-1)
        dev = backend.asarray(padded)
        return dev[0][..., :HEAD_SIZE], dev[1][..., :HEAD_SIZE]
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["fused-qkv", "padded-heads"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_takes_strided_key_value_views(hal_backend: Any, hal_seed: int, dtype: str,
                                                      layout: str) -> None:
    """K/V views with a contiguous last dimension (a fused QKV projection's slices) are written exactly."""
    args = _inputs(_rng(hal_seed, f"strided-{dtype}-{layout}"), dtype)
    expected_k, expected_v = REFERENCE(args)
    key, value = _views(hal_backend, args, layout)
    assert not is_c_contiguous(key) and not is_c_contiguous(value), "the views must be strided"
    kc, vc = hal_backend.asarray(args["key_cache"]), hal_backend.asarray(args["value_cache"])
    hal_backend.ops.write_kv_cache(key, value, kc, vc, hal_backend.asarray(args["slot_mapping"]))
    assert_close(hal_backend.to_numpy(kc), expected_k, kind="copy", dtype=dtype, what="key_cache")
    assert_close(hal_backend.to_numpy(vc), expected_v, kind="copy", dtype=dtype, what="value_cache")


def test_write_kv_cache_refuses_a_strided_last_dimension(hal_backend: Any, hal_seed: int) -> None:
    """A key whose elements are not contiguous (every other one) is refused naming 'key'; caches unchanged."""
    args = _inputs(_rng(hal_seed, "strided-last"), "fp32")
    wide = hal_backend.asarray(np.repeat(args["key"], 2, axis=-1))
    kc, vc = hal_backend.asarray(args["key_cache"]), hal_backend.asarray(args["value_cache"])
    with pytest.raises(ArgumentError, match=r"'key'.*contiguous last dimension"):
        hal_backend.ops.write_kv_cache(wide[..., ::2], hal_backend.asarray(args["value"]), kc, vc,
                                       hal_backend.asarray(args["slot_mapping"]))
    np.testing.assert_array_equal(hal_backend.to_numpy(kc), args["key_cache"])


@pytest.mark.parametrize("case", ["same-array", "overlapping-views"])
def test_write_kv_cache_refuses_one_array_as_both_caches(hal_backend: Any, hal_seed: int, case: str) -> None:
    """One array (or overlapping views of one) as key_cache and value_cache is refused naming both, unwritten."""
    args = _inputs(_rng(hal_seed, f"alias-{case}"), "fp16")
    both = np.concatenate([args["key_cache"], args["value_cache"]])  # [2 * num_blocks, ...]
    dev = hal_backend.asarray(both)
    kc, vc = (dev, dev) if case == "same-array" else (dev[0:NUM_BLOCKS], dev[1:NUM_BLOCKS + 1])
    with pytest.raises(ArgumentError, match="'key_cache' and 'value_cache'"):
        hal_backend.ops.write_kv_cache(hal_backend.asarray(args["key"]), hal_backend.asarray(args["value"]), kc, vc,
                                       hal_backend.asarray(args["slot_mapping"]))
    np.testing.assert_array_equal(hal_backend.to_numpy(dev).view(np.uint16), both.view(np.uint16))


def test_write_kv_cache_takes_the_two_halves_of_one_buffer(hal_backend: Any, hal_seed: int) -> None:
    """Disjoint halves of one allocation (an engine's kv[0] and kv[1]) are two separate caches: accepted."""
    args = _inputs(_rng(hal_seed, "halves"), "bf16")
    expected_k, expected_v = REFERENCE(args)
    dev = hal_backend.asarray(np.stack([args["key_cache"], args["value_cache"]]))
    hal_backend.ops.write_kv_cache(hal_backend.asarray(args["key"]), hal_backend.asarray(args["value"]), dev[0], dev[1],
                                   hal_backend.asarray(args["slot_mapping"]))
    got = np.asarray(hal_backend.to_numpy(dev))
    assert_close(got[0], expected_k, kind="copy", dtype="bf16", what="key_cache")
    assert_close(got[1], expected_v, kind="copy", dtype="bf16", what="value_cache")


@pytest.mark.parametrize("read_only", ["key_cache", "value_cache"])
def test_write_kv_cache_refuses_a_read_only_cache_before_writing(hal_backend: Any, hal_seed: int,
                                                                 read_only: str) -> None:
    """A read-only cache (host numpy) is refused naming it, and the other cache is left unwritten."""
    args = _inputs(_rng(hal_seed, f"read-only-{read_only}"), "fp32")
    before = {name: args[name].copy() for name in ("key_cache", "value_cache")}
    args[read_only].flags.writeable = False
    with pytest.raises(ArgumentError, match=f"{read_only!r} is read-only"):
        hal_backend.ops.write_kv_cache(args["key"], args["value"], args["key_cache"], args["value_cache"],
                                       args["slot_mapping"])
    for name, value in before.items():
        np.testing.assert_array_equal(args[name], value, err_msg=f"{name} was written")
