"""``write_kv_cache``: scatter new keys and values into the paged cache.

``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` go to
``key_cache``/``value_cache`` ``[num_blocks, num_kv_heads, block_size, head_size]``
at ``slot_mapping[i] = block * block_size + offset`` (int32 or int64);
a negative slot skips that token. Slots must be distinct.

``key`` and ``value`` may be strided views whose last dimension is
contiguous (the key and value slices of a fused QKV projection, as engines
pass them); so may the caches (an engine's own cache layout, e.g. the K and V
halves of a ``[..., 2 * block_size, head_size]`` view), which must be
writable and never share an element. Every check runs before anything is
written.

Slot values of a host (numpy) ``slot_mapping`` are checked on the host
(range and distinctness, ``HAL_CHECK_INDICES``); a device ``slot_mapping``
is checked by the kernel, which skips a token whose slot is past the cache
and reports ``slot_mapping`` through the device error flag
(:func:`hal_core.check_errors`); two tokens given one device slot leave one
of them there, unspecified which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..arrays import dtype_name, numpy_dtype
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import check_disjoint, check_slots, check_writable, host_index_checks
from ._declare import Arg, BenchCases, Feature
from ._index_memo import PassedIndices
from ._inputs import uniform
from ._spec import OpSpec
from .paged_attention import attention_dtypes

__all__ = ["WriteKVCache", "write_kv_cache_inputs"]

_TOKENS = "[num_tokens, num_kv_heads, head_size]"
_CACHE = "[num_blocks, num_kv_heads, block_size, head_size]"

#: The last slot mapping whose checks passed (a step's layers share it).
_PASSED = PassedIndices()


class WriteKVCache(OpSpec):
    """Scatter a step's new keys and values into the paged cache through a slot mapping."""

    name = "write_kv_cache"
    args = (
        Arg.array("key", _TOKENS, dtype_of="key_cache", contiguous="last"),
        Arg.array("value", _TOKENS, dtype_of="key_cache", contiguous="last"),
        Arg.array("key_cache", _CACHE, dtypes=attention_dtypes, contiguous="last", mutated=True),
        Arg.array("value_cache", _CACHE, dtype_of="key_cache", contiguous="last", mutated=True),
        Arg.index("slot_mapping", "[num_tokens]", dtypes=("int32", "int64"),
                  doc="block * block_size + offset per token; negative skips the token"),
    )
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["key_cache"])),
        Feature("head_size", "head_sizes", lambda args: int(args["key_cache"].shape[3])),
        Feature("block_size", "block_sizes", lambda args: int(args["key_cache"].shape[2])),
    )

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        check_writable("key_cache", args["key_cache"])
        check_writable("value_cache", args["value_cache"])
        check_disjoint("key_cache", args["key_cache"], "value_cache", args["value_cache"])
        if sizes["num_tokens"] and host_index_checks(args["slot_mapping"]):
            self.check_index_values(args)

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Slots below ``num_blocks * block_size`` (or negative) and distinct (a host ``slot_mapping``; skipped where
        the last call's that passed held the same values, :mod:`~hal_core.ops._index_memo`)."""
        kc = args["key_cache"]
        slots, capacity = np.asarray(args["slot_mapping"]), kc.shape[0] * kc.shape[2]
        key = _PASSED.key((capacity,), slots)
        if not _PASSED.passed(key):  # else the same slots passed on the last call (another layer of the step)
            check_slots(slots, capacity)
            _PASSED.keep(key)

    def is_empty(self, args: Mapping[str, Any]) -> bool:
        return 0 in args["key"].shape

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``dtype:t<pow2 tokens>``."""
        return f"{dtype_name(args['key'])}:t{pow2(args['key'].shape[0])}"

    def flops(self, args: Mapping[str, Any]) -> int:
        return 0

    def nbytes(self, args: Mapping[str, Any]) -> int:
        k = args["key"]
        return 4 * int(np.prod(k.shape)) * k.dtype.itemsize

    def reference(self, args: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        kc = np.asarray(args["key_cache"]).astype(np.float64)
        vc = np.asarray(args["value_cache"]).astype(np.float64)
        slots = np.asarray(args["slot_mapping"]).astype(np.int64)
        keep = slots >= 0
        block_size = kc.shape[2]
        blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
        kc[blocks, :, offsets] = np.asarray(args["key"]).astype(np.float64)[keep]
        vc[blocks, :, offsets] = np.asarray(args["value"]).astype(np.float64)[keep]
        return kc, vc


def write_kv_cache_inputs(
    rng: np.random.Generator,
    *,
    num_tokens: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: str,
    skip_fraction: float = 0.25,
) -> dict[str, Any]:
    """Host arguments: distinct slots, some negative (skipped); cache slots not written hold NaN."""
    capacity = num_blocks * block_size
    if num_tokens > capacity:
        raise ValueError(f"num_tokens={num_tokens} exceeds the cache's {capacity} slots")
    slots = rng.permutation(capacity)[:num_tokens].astype(np.int64)
    slots[rng.random(num_tokens) < skip_fraction] = -1
    token_shape = (num_tokens, num_kv_heads, head_size)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
    np_dtype = numpy_dtype(dtype)
    key_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    value_cache = rng.standard_normal(cache_shape).astype(np_dtype)
    unwritten = np.ones(capacity, dtype=bool)
    unwritten[slots[slots >= 0]] = False
    for cache in (key_cache, value_cache):
        cache.transpose(0, 2, 1, 3)[unwritten.reshape(num_blocks, block_size)] = np.nan
    return {
        "key": rng.standard_normal(token_shape).astype(np_dtype),
        "value": rng.standard_normal(token_shape).astype(np_dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": slots.astype(np.int32 if rng.random() < 0.5 else np.int64),
    }


def _blocks(p: Mapping[str, Any]) -> int:
    return int(p["blocks"]) or max(2 * -(-p["tokens"] // p["block"]), 64)


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    tokens, block, num_blocks = p["tokens"], p["block"], _blocks(p)
    shape = (num_blocks, p["kv_heads"], block, p["head"])
    slots = rng.permutation(num_blocks * block)[:tokens].astype(np.int64)
    return {
        "key": uniform(rng, (tokens, p["kv_heads"], p["head"]), p["dtype"]),
        "value": uniform(rng, (tokens, p["kv_heads"], p["head"]), p["dtype"]),
        "key_cache": np.zeros(shape, dtype=numpy_dtype(p["dtype"])),
        "value_cache": np.zeros(shape, dtype=numpy_dtype(p["dtype"])),
        "slot_mapping": slots,
    }


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    return write_kv_cache_inputs(rng, num_tokens=p["tokens"], num_blocks=-(-p["tokens"] // p["block"]) + 1,
                                 num_kv_heads=p["kv_heads"], block_size=p["block"], head_size=p["head"],
                                 dtype=p["dtype"])


def _check_case(p: Mapping[str, Any]) -> str | None:
    if p["blocks"] and p["blocks"] * p["block"] < p["tokens"]:
        return f"blocks*block must hold tokens={p['tokens']}"
    return None


WriteKVCache.bench = BenchCases(
    params={"tokens": 32, "kv_heads": 8, "head": 128, "block": 16, "blocks": 0, "dtype": "fp16"},
    aliases={"head_size": "head", "block_size": "block", "num_tokens": "tokens", "num_kv_heads": "kv_heads"},
    may_be_zero=frozenset({"blocks"}),
    label=lambda p: f"write_kv_cache {p['dtype']} {p['tokens']} tok h{p['kv_heads']} d{p['head']}",
    check=_check_case,
    inputs=_bench_inputs,
    presets={
        "decode": lambda: [{"tokens": t, "dtype": dt} for t in (8, 64) for dt in ("fp16", "fp32")],
        "prefill": lambda: [{"tokens": t, "dtype": "fp16"} for t in (512, 4096)],
    },
    explain=({"dtype": "fp16", "head": 128, "block": 16, "tokens": 8, "kv_heads": 8},
             {"dtype": "bf16", "head": 64, "block": 32, "tokens": 1, "kv_heads": 1}),
    test_inputs=_test_inputs,
    tiny={"tokens": 2, "kv_heads": 1, "head": 64, "block": 16, "blocks": 2, "dtype": "fp32"},
)

register_op(WriteKVCache())
