"""``rotary_embedding`` on the host: head rows rotated in place, parallel over rows (csrc/rotary_embedding.inl).

``query``/``key`` may be strided views (a fused QKV projection's slices) whose last dimension is contiguous;
``positions`` are int32 or int64; the table's rows are float32 cosines then sines.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from hal_core.ops import OpCall, Runner
from hal_core.ops.rotary_embedding import rotary_pairs

from .. import _abi, _native
from . import _rules
from ._native_args import dtype_code, element_strides, fill_struct
from ._planned import struct_runner

__all__ = ["plan_rotary_embedding", "rotary_embedding", "rotate"]


def rotary_embedding(call: OpCall) -> None:
    """Rotate ``query`` (and ``key``) in place by their tokens' rows of ``cos_sin_cache``."""
    rotate(np.asarray(call["positions"]), call["query"], call["cos_sin_cache"], call.args.get("key"),
           style=call.args.get("style"))


def _direct(array: np.ndarray | None) -> bool:
    """Whether the kernel can address ``array`` in place: whole-element strides, a contiguous last dimension."""
    if array is None:
        return True
    item = array.itemsize
    return (array.shape[-1] <= 1 or array.strides[-1] == item) and all(s % item == 0 for s in array.strides)


def rotate(positions: np.ndarray, query: np.ndarray, cos_sin_cache: np.ndarray, key: np.ndarray | None = None, *,
           style: str | None = None, threads: int | None = None) -> None:
    """The rotation of validated numpy inputs (``threads`` defaults to :func:`~hal_cpu.ops._rules.threads_for`)."""
    native = _native.try_load()
    if native is None or not (_direct(query) and _direct(key)):
        _numpy_rotate(positions, query, cos_sin_cache, key, style)
        return
    positions = positions if positions.flags.c_contiguous else np.ascontiguousarray(positions)
    table = cos_sin_cache if cos_sin_cache.flags.c_contiguous else np.ascontiguousarray(cos_sin_cache)
    args = fill_struct(_abi.RotaryEmbeddingArgs, _fields(positions, query, table, key, style, threads,
                                                         native.threads))
    native.lib.hal_cpu_rotary_embedding(ctypes.byref(args))


def plan_rotary_embedding(call: OpCall) -> Runner | None:
    """The runner of ``call``'s signature (:mod:`._planned`), or None where the kernel cannot take its arrays as
    they are."""
    native = _native.try_load()
    positions, query, table, key = call["positions"], call["query"], call["cos_sin_cache"], call.args.get("key")
    if native is None or not (_direct(query) and _direct(key) and positions.flags.c_contiguous
                              and table.flags.c_contiguous):
        return None
    fields = _fields(positions, query, table, key, call.args.get("style"), None, native.threads)
    return struct_runner(call, rotary_embedding, native.lib.hal_cpu_rotary_embedding, _abi.RotaryEmbeddingArgs,
                         fields, {"positions": "positions", "query": "query", "key": "key",
                                  "cos_sin_cache": "cos_sin_cache"})


def _fields(positions: np.ndarray, query: np.ndarray, table: np.ndarray, key: np.ndarray | None, style: str | None,
            threads: int | None, host_threads: int) -> dict[str, Any]:
    """The kernel's argument struct, by field."""
    num_tokens, num_heads, _ = query.shape
    rotary_dim = table.shape[1]
    rows = num_tokens * (num_heads + (key.shape[1] if key is not None else 0))
    if threads is None:
        threads = _rules.threads_for(2 * rows * rotary_dim * query.itemsize, host_threads)
    qts, qhs, _ = element_strides(query)
    kts, khs, _ = element_strides(key) if key is not None else (0, 0, 0)
    return dict(positions=positions, query=query, q_token_stride=qts, q_head_stride=qhs, key=key,
                k_token_stride=kts, k_head_stride=khs, cos_sin_cache=table, num_tokens=num_tokens,
                max_position=table.shape[0], position_bytes=positions.itemsize, num_heads=num_heads,
                num_kv_heads=key.shape[1] if key is not None else 0, rotary_dim=rotary_dim, dtype=dtype_code(query),
                gptj=int(style == "gptj"), threads=int(threads))


def _numpy_rotate(positions: np.ndarray, query: np.ndarray, cos_sin_cache: np.ndarray, key: np.ndarray | None,
                  style: str | None) -> None:
    """The fallback (no compiled kernels, or rows the kernel cannot address): float32 arithmetic, then the writes."""
    rotary_dim = cos_sin_cache.shape[1]
    rows = cos_sin_cache[positions.astype(np.int64)]
    cos, sin = rows[:, None, : rotary_dim // 2], rows[:, None, rotary_dim // 2:]
    first, second = rotary_pairs(rotary_dim, style)
    results = []
    for x in (query, key):
        if x is None:
            continue
        x1, x2 = x[..., first].astype(np.float32), x[..., second].astype(np.float32)
        results.append((x, (x1 * cos - x2 * sin).astype(x.dtype), (x2 * cos + x1 * sin).astype(x.dtype)))
    for x, new1, new2 in results:  # computed first: nothing is written if this fails
        x[..., first] = new1
        x[..., second] = new2
