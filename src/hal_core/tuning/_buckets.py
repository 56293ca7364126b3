"""Shape buckets: the classes of calls one tuned choice covers, defined once per op.

A bucket is a short string computed from shapes only (never from device
data, so no device-to-host copy): powers of two of M for quantized_gemm
(with the weight's bits), of the batch and of the context length for
paged_attention (the longest ``seq_lens`` on host arrays, the block
table's capacity on device arrays), of the token count for write_kv_cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["bucket", "pow2"]


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _dtype(array: Any) -> str:
    from ..arrays import dtype_name

    try:
        return dtype_name(array)
    except Exception:  # an unknown dtype gets its own bucket name instead of failing the call
        return str(array.dtype)


def _context(args: Mapping[str, Any]) -> int:
    seq_lens = args["seq_lens"]
    import numpy as np

    if isinstance(seq_lens, np.ndarray) and seq_lens.size:
        return int(seq_lens.max())
    return int(args["block_tables"].shape[1]) * int(args["key_cache"].shape[2])


def bucket(op: str, args: Mapping[str, Any]) -> str:
    """The bucket of a call of ``op`` with ``args`` (validated arguments)."""
    if op == "quantized_gemm":
        return f"w{args['qweight'].bits}:m{pow2(args['x'].shape[0])}"
    if op == "paged_attention":
        q = args["query"]
        return f"{_dtype(q)}:b{pow2(q.shape[0])}:ctx{pow2(_context(args))}"
    if op == "write_kv_cache":
        return f"{_dtype(args['key'])}:t{pow2(args['key'].shape[0])}"
    return "all"
