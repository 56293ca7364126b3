"""``torch.ops.hal.*``: hal's ops as torch custom operators.

Each op is registered with :func:`torch.library.custom_op` (a schema, the
arguments it mutates) and a fake implementation that computes only output
shapes and dtypes, so ``torch.compile`` traces through it without a graph
break and a CUDA graph captures its launches. The real implementation hands
the tensors to the hal backend that owns their device (:mod:`._routing`),
unchanged: hal converts them without a copy and applies its own validation,
fallback and strict-mode rules. Outputs are allocated by torch (so a CUDA
graph's memory pool owns them) and written by hal through ``out=``.

=============================  ==========================================  ==================
op                             returns                                     mutates
=============================  ==========================================  ==================
``hal::paged_attention``       a new ``[num_seqs, num_heads, head_size]``  nothing
``hal::paged_attention_out``   nothing                                     ``out``
``hal::write_kv_cache``        nothing                                     both caches
``hal::quantized_gemm``        a new ``[M, N]`` in ``x``'s dtype           nothing
=============================  ==========================================  ==================
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ._routing import backend_for, on_torch_stream
from ._weights import _weight

__all__ = ["paged_attention", "quantized_gemm", "write_kv_cache"]


# -- paged_attention ------------------------------------------------------------


def _run_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                         seq_lens: Tensor, scale: float, out: Tensor, max_seq_len: int | None) -> None:
    backend = backend_for(query)
    with on_torch_stream(backend, query):
        backend.ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale, out=out,
                                    max_seq_len=max_seq_len)


@torch.library.custom_op("hal::paged_attention", mutates_args=())
def _paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                     seq_lens: Tensor, scale: float, max_seq_len: int | None = None) -> Tensor:
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _run_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out, max_seq_len)
    return out


@_paged_attention.register_fake
def _paged_attention_fake(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                          seq_lens: Tensor, scale: float, max_seq_len: int | None = None) -> Tensor:
    _check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens)
    return query.new_empty(query.shape)


@torch.library.custom_op("hal::paged_attention_out", mutates_args=("out",))
def _paged_attention_out(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                         seq_lens: Tensor, scale: float, out: Tensor, max_seq_len: int | None = None) -> None:
    _run_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out, max_seq_len)


@_paged_attention_out.register_fake
def _paged_attention_out_fake(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                              seq_lens: Tensor, scale: float, out: Tensor, max_seq_len: int | None = None) -> None:
    _check_attention_shapes(query, key_cache, value_cache, block_tables, seq_lens)
    if tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype:
        raise ValueError(f"argument 'out': expected shape {tuple(query.shape)} and dtype {query.dtype} "
                         f"(the query's), got {tuple(out.shape)} {out.dtype}")


def _check_attention_shapes(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                            seq_lens: Tensor) -> None:
    """The shape facts a trace can check (ranks and matching sizes); hal checks the rest when it runs."""
    for name, tensor, ndim in (("query", query, 3), ("key_cache", key_cache, 4), ("value_cache", value_cache, 4),
                               ("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
        if tensor.ndim != ndim:
            raise ValueError(f"argument {name!r}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}")


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, scale: float, out: Tensor | None = None,
                    max_seq_len: int | None = None) -> Tensor:
    """Decode attention over a paged KV cache (layout: :mod:`hal_core.ops.paged_attention`).

    With ``out`` the result is written there (``hal::paged_attention_out``)
    and ``out`` is returned; otherwise a new tensor (``hal::paged_attention``).
    ``max_seq_len`` bounds ``seq_lens`` (a host int: device work is sized
    from it without reading the device).
    """
    if out is None:
        return torch.ops.hal.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                             max_seq_len)
    torch.ops.hal.paged_attention_out(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                                      max_seq_len)
    return out


# -- write_kv_cache -------------------------------------------------------------


@torch.library.custom_op("hal::write_kv_cache", mutates_args=("key_cache", "value_cache"))
def _write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                    slot_mapping: Tensor) -> None:
    backend = backend_for(key)
    with on_torch_stream(backend, key):
        backend.ops.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


@_write_kv_cache.register_fake
def _write_kv_cache_fake(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                         slot_mapping: Tensor) -> None:
    for name, tensor, ndim in (("key", key, 3), ("value", value, 3), ("key_cache", key_cache, 4),
                               ("value_cache", value_cache, 4), ("slot_mapping", slot_mapping, 1)):
        if tensor.ndim != ndim:
            raise ValueError(f"argument {name!r}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}")


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter ``key``/``value`` into the caches in place (layout: :mod:`hal_core.ops.write_kv_cache`)."""
    torch.ops.hal.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


# -- quantized_gemm -------------------------------------------------------------


@torch.library.custom_op("hal::quantized_gemm", mutates_args=())
def _quantized_gemm(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, g_idx: Tensor | None,
                    bits: int, group_size: int) -> Tensor:
    weight = _weight(qweight, scales, zeros, g_idx, bits, group_size)
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    backend = backend_for(x)
    with on_torch_stream(backend, x):
        backend.ops.quantized_gemm(x, weight, out=out)
    return out


@_quantized_gemm.register_fake
def _quantized_gemm_fake(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, g_idx: Tensor | None,
                         bits: int, group_size: int) -> Tensor:
    if x.ndim != 2:
        raise ValueError(f"argument 'x': expected [M, K], got shape {tuple(x.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"argument 'bits': expected 4 or 8, got {bits}")
    if qweight.ndim != 2:
        raise ValueError(f"argument 'qweight': expected 2 dimensions, got shape {tuple(qweight.shape)}")
    k = qweight.shape[0] * (8 if bits == 4 else 1)
    torch._check(x.shape[1] == k, lambda: f"argument 'x': expected K={k} columns (the weight's), "
                                          f"got shape {tuple(x.shape)}")
    return x.new_empty((x.shape[0], qweight.shape[1]))


def quantized_gemm(x: Tensor, weight: Mapping[str, Tensor], bits: int) -> Tensor:
    """``x [M, K]`` times the quantized weight held as ``weight`` (see :func:`weight_to_tensors`)."""
    qweight, scales = weight["qweight"], weight["scales"]
    k = qweight.shape[0] * (8 if bits == 4 else 1)
    group_size = k // scales.shape[0] if scales.shape[0] else 0
    return torch.ops.hal.quantized_gemm(x, qweight, scales, weight.get("zeros"), weight.get("g_idx"),
                                        bits, group_size)
