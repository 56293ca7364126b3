"""write_kv_cache against the float64 reference (bit-exact), plus edge cases and errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, to_backend, write_kv_cache_inputs
from hal_core.testing.suite._strategies import BLOCK_SIZES, DTYPES, HEAD_SIZES, OP_SETTINGS, seeds

REFERENCE = OPS["write_kv_cache"].reference


def _run(backend: Any, args: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    dev = to_backend(backend, "write_kv_cache", args)
    result = backend.ops.write_kv_cache(dev["key"], dev["value"], dev["key_cache"], dev["value_cache"],
                                        dev["slot_mapping"])
    assert result is None
    return backend.to_numpy(dev["key_cache"]), backend.to_numpy(dev["value_cache"])


@OP_SETTINGS
@given(
    seed=seeds,
    dtype=st.sampled_from(DTYPES),
    head_size=st.sampled_from(HEAD_SIZES),
    block_size=st.sampled_from(BLOCK_SIZES),
    num_kv_heads=st.integers(1, 4),
    num_blocks=st.integers(1, 12),
    fill=st.floats(0.0, 1.0),
)
def test_write_kv_cache_matches_reference(hal_backend: Any, seed: int, dtype: str, head_size: int,
                                          block_size: int, num_kv_heads: int, num_blocks: int,
                                          fill: float) -> None:
    """Every kept token lands in its slot, negative slots are skipped, nothing else changes."""
    rng = np.random.default_rng(seed)
    num_tokens = int(fill * num_blocks * block_size)
    args = write_kv_cache_inputs(rng, num_tokens=num_tokens, num_blocks=num_blocks, num_kv_heads=num_kv_heads,
                                 block_size=block_size, head_size=head_size, dtype=dtype)
    expected_k, expected_v = REFERENCE(args)
    got_k, got_v = _run(hal_backend, args)
    assert_close(got_k, expected_k, kind="copy", dtype=dtype, what="key_cache")
    assert_close(got_v, expected_v, kind="copy", dtype=dtype, what="value_cache")


def test_write_kv_cache_all_negative_slots(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """Only negative slots: the caches are unchanged."""
    args = write_kv_cache_inputs(hal_rng, num_tokens=6, num_blocks=2, num_kv_heads=2, block_size=8,
                                 head_size=64, dtype="fp16", skip_fraction=1.0)
    before_k, before_v = args["key_cache"].copy(), args["value_cache"].copy()
    got_k, got_v = _run(hal_backend, args)
    np.testing.assert_array_equal(got_k, before_k)
    np.testing.assert_array_equal(got_v, before_v)


def test_write_kv_cache_no_tokens(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """num_tokens = 0 is a no-op."""
    args = write_kv_cache_inputs(hal_rng, num_tokens=0, num_blocks=2, num_kv_heads=1, block_size=16,
                                 head_size=64, dtype="bf16")
    before = args["key_cache"].copy()
    got_k, _ = _run(hal_backend, args)
    np.testing.assert_array_equal(got_k.view(np.uint16), before.view(np.uint16))


BAD_INPUTS = [
    ("slot-dtype", ArgumentTypeError, "slot_mapping"),
    ("key-rank", ArgumentError, "key"),
    ("value-shape", ArgumentError, "value"),
    ("key-dtype", ArgumentTypeError, "key"),
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_write_kv_cache_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str,
                                  error: type[Exception], argument: str) -> None:
    """Bad input raises the right error naming the argument and leaves the caches untouched."""
    args = write_kv_cache_inputs(hal_rng, num_tokens=4, num_blocks=2, num_kv_heads=2, block_size=8,
                                 head_size=64, dtype="fp32", skip_fraction=0.0)
    if case == "slot-dtype":
        args["slot_mapping"] = args["slot_mapping"].astype(np.float32)
    elif case == "key-rank":
        args["key"] = args["key"][0]
    elif case == "value-shape":
        args["value"] = args["value"][:3].copy()
    elif case == "key-dtype":
        args["key"], args["value"] = args["key"].astype(np.float16), args["value"].astype(np.float16)
    before_k, before_v = args["key_cache"].copy(), args["value_cache"].copy()
    dev = to_backend(hal_backend, "write_kv_cache", args)
    with pytest.raises(error) as info:
        hal_backend.ops.write_kv_cache(dev["key"], dev["value"], dev["key_cache"], dev["value_cache"],
                                       dev["slot_mapping"])
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    np.testing.assert_array_equal(hal_backend.to_numpy(dev["key_cache"]), before_k)
    np.testing.assert_array_equal(hal_backend.to_numpy(dev["value_cache"]), before_v)


@pytest.mark.parametrize("case", ["slot-out-of-range", "slot-duplicate"])
def test_write_kv_cache_bad_slots(hal_backend: Any, hal_rng: np.random.Generator, case: str) -> None:
    """A slot past the cache is never written and is reported naming slot_mapping; so is a duplicate on the host.

    Host arrays: an ``ArgumentError`` at the call, caches untouched. Device arrays may be checked by the kernel
    instead: the bad token is skipped, the others land, and :func:`hal_core.check_errors` raises. Two tokens
    given one device slot may go unreported: then one of them is in that slot and everything else is right.
    """
    args = write_kv_cache_inputs(hal_rng, num_tokens=4, num_blocks=2, num_kv_heads=2, block_size=8,
                                 head_size=64, dtype="fp32", skip_fraction=0.0)
    slots = args["slot_mapping"]
    if case == "slot-out-of-range":
        slots[0] = 2 * 8
    else:  # token 2 writes token 0's slot
        slots[2] = slots[0]
    before_k, before_v = args["key_cache"].copy(), args["value_cache"].copy()
    dev = to_backend(hal_backend, "write_kv_cache", args)
    try:
        hal_backend.ops.write_kv_cache(dev["key"], dev["value"], dev["key_cache"], dev["value_cache"],
                                       dev["slot_mapping"])
    except ArgumentError as exc:
        assert "'slot_mapping'" in str(exc), f"message does not name 'slot_mapping': {exc}"
        np.testing.assert_array_equal(hal_backend.to_numpy(dev["key_cache"]), before_k)
        np.testing.assert_array_equal(hal_backend.to_numpy(dev["value_cache"]), before_v)
        return
    assert not hal_backend.is_host, "a host backend must check slots before any write"
    got_k = hal_backend.to_numpy(dev["key_cache"])
    if case == "slot-out-of-range":
        with pytest.raises(ArgumentError, match="'slot_mapping'"):
            hal_core.check_errors()
        keep = np.arange(4) != 0
        want_k, _ = REFERENCE(dict(args, key=args["key"][keep], value=args["value"][keep], slot_mapping=slots[keep]))
        np.testing.assert_array_equal(got_k, want_k)
        return
    hal_core.check_errors()  # a duplicate is no out-of-range access: nothing to report
    block, offset = divmod(int(slots[0]), 8)
    landed = got_k[block, :, offset]
    assert any(np.array_equal(landed, args["key"][t]) for t in (0, 2)), "the shared slot holds neither token"
    for t in (1, 3):
        b, o = divmod(int(slots[t]), 8)
        np.testing.assert_array_equal(got_k[b, :, o], args["key"][t])
