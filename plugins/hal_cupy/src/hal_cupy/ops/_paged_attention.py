"""``paged_attention`` on a GPU: tensor-core or SIMT kernels, single-pass or split-KV, chosen by
:mod:`~hal_cupy.ops._paged_attention_rules`.

Every call the op's contract allows runs here (decode, prefill, chunked prefill and mixed batches; sliding
window, softcap, sinks, ALiBi; strided cache views whose strides keep 16-byte rows), except head sizes outside
``PA_HEAD_SIZES``, block sizes outside ``PA_BLOCK_SIZES`` and arrays the kernels cannot address (see
:func:`check`).

Selection, per call:

- Tensor cores (the platform's warp matrix instructions at level ``PA_TC_MIN_SM``, see
  :meth:`hal_cupy.GpuPlatform.warp_mma_level`; fp16/bf16 caches; prefill rows, or at least ``PA_TC_MIN_GROUP``
  query heads per KV head; a head size of ``PA_TC_HEAD_SIZES``; ``HAL_<BACKEND>_TENSOR_CORES`` not 0):
  ``paged_attention_tc.cu``.
  Its partitions come from compute units x the kernel's occupancy (the device's shared memory, threads and
  registers per compute unit against the compiled kernel's, bounded by the runtime's occupancy calculator) and
  the sequence-length bound (below); a split is merged by ``hal_paged_attention_reduce`` of
  ``paged_attention.cu``, in column slices that give every compute unit a CTA.
  With prefill rows the group size does not matter (new tokens fill the 16 rows of a CTA); every variant runs
  there, strided caches too when both caches have the same strides (else the SIMT kernels).
- Otherwise (fp32, small decode groups, other head sizes, caches of different strides, devices without those
  instructions): the SIMT kernels of ``paged_attention.cu``, single-pass or split-KV by
  :func:`choose_paged_attention_variant`.
  A call with prefill rows passes ``query_start_loc`` and tiles of ``PA_PREFILL_ROWS`` (new token, query head)
  rows per CTA; its output is allocated zeroed (rows of a sequence whose ``query_start_loc`` entries are bad stay
  zeros). A decode call (``is_prefill`` false) does not read ``query_start_loc``.

Nothing is read from the device and nothing synchronises (the call is CUDA-graph capturable): partitions and
workspaces are sized from :func:`seq_len_bound` -- the caller's ``max_seq_len``, else the block table's
capacity -- and the kernels check every length against that bound and every used block id against the cache,
reporting a bad one through the device error flag (:mod:`hal_cupy._index_errors`) with that sequence's output
zeroed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hal_core.arrays import dtype_name, is_c_contiguous
from hal_core.ops import OpCall
from hal_core.ops.paged_attention import is_prefill
from hal_core.ops.paged_attention import variants as _variants

from .._arrays import KERNEL_DTYPES, as_storage, empty_like_dtype, zeros_like_dtype
from .._cupy import cupy
from .._index_errors import error_flag
from ._common import GpuOp, kernels_for, launch, misaligned, storage_device, tensor_cores_available
from ._paged_attention_rules import (
    PA_BLOCK_SIZES,
    PA_HEAD_SIZES,
    PA_PARTITION_SIZE,
    PA_TC_MIN_SM,
    choose_paged_attention_variant,
    paged_attention_launches,
    paged_attention_partitions,
    paged_attention_rows,
    paged_attention_spec,
    paged_attention_tc_ctas_per_cu,
    paged_attention_tc_launches,
    paged_attention_tc_partitions,
    paged_attention_tc_spec,
    paged_attention_uses_tensor_cores,
    specializations,
)

__all__ = ["OP", "cache_strides", "check", "query_len_bound", "run", "seq_len_bound", "split_workspace_bytes",
           "uses_tensor_cores"]


def split_workspace_bytes(num_tokens: int, num_heads: int, head_size: int, max_seq_len: int) -> int:
    """fp32 bytes of ``tmp_out``, ``max_logits`` and ``exp_sums`` for the split-KV variant (``num_tokens`` query
    rows: ``num_seqs`` for decode)."""
    parts = paged_attention_partitions(max_seq_len, PA_PARTITION_SIZE)
    return 4 * num_tokens * num_heads * parts * (head_size + 2)


def query_len_bound(call: OpCall) -> int:
    """The most new tokens of one sequence the launches are sized for, known on the host: 1 for decode (no
    prefill rows), else ``min(max_query_len, num_tokens)`` (``num_tokens`` without the hint). The kernels treat
    a longer sequence as an index error (``query_start_loc`` in the error flag)."""
    if not is_prefill(call.args):
        return 1
    num_tokens = int(call["query"].shape[0])
    bound = call.args.get("max_query_len")
    return max(1, num_tokens if bound is None else min(int(bound), num_tokens))


def cache_strides(cache: Any) -> tuple[int, int, int] | None:
    """Element strides (block, KV head, token) of a ``[num_blocks, num_kv_heads, block_size, head_size]`` cache,
    or None when the kernels cannot address it: a last dimension that is not contiguous, a negative stride, or a
    row that does not start on a 16-byte boundary (a byte stride that is not a multiple of 16)."""
    item = cache.dtype.itemsize
    strides = tuple(int(x) for x in cache.strides)
    if strides[3] != item or any(x < 0 or x % 16 for x in strides[:3]):
        return None
    return strides[0] // item, strides[1] // item, strides[2] // item


def seq_len_bound(call: OpCall) -> int:
    """The longest sequence the launches are sized for, known on the host: ``min(max_seq_len, capacity)``.

    ``capacity`` is the block table's ``max_blocks_per_seq * block_size``;
    without a ``max_seq_len`` it is the bound. The kernels treat a length
    beyond it as an index error (``seq_lens`` in the error flag).
    """
    capacity = call["block_tables"].shape[1] * call["key_cache"].shape[2]
    bound = call.args.get("max_seq_len")
    return capacity if bound is None else min(int(bound), capacity)


def uses_tensor_cores(backend: Any, device_index: int, hal_dtype: str, num_heads: int, num_kv_heads: int,
                      head_size: int, prefill: bool = False) -> bool:
    """True when ``paged_attention_tc.cu`` may serve this call (see the module docs; the caller also needs the
    value cache's strides to equal the key cache's)."""
    if not tensor_cores_available(backend, device_index, PA_TC_MIN_SM):
        return False
    level = backend.platform.warp_mma_level(backend.device(device_index).capabilities)
    dtype = {"fp16": "float16", "bf16": "bfloat16"}.get(hal_dtype, hal_dtype)
    return paged_attention_uses_tensor_cores(level, dtype, num_heads // num_kv_heads, head_size, prefill)


def _attention_options(call: OpCall) -> dict[str, Any]:
    """The call's :class:`~hal_core.ops.AttentionOptions` (``call.options``, received whole) as the kernels take
    them (README ``P``): ``scale``, ``softcap`` (0: none), ``window`` (0: none), ``sinks`` and ``alibi_slopes``
    (device arrays or None). The one place that reads them."""
    options = call.options
    sinks, slopes = (None if a is None else as_storage(a) for a in (options.sinks, options.alibi_slopes))
    return {"scale": options.scale, "softcap": 0.0 if options.softcap is None else options.softcap,
            "window": options.window or 0, "sinks": sinks, "alibi_slopes": slopes}


def _run_tensor_cores(call: OpCall, device_index: int, out: Any, kdtype: str, shared: dict[str, Any],
                      checks: dict[str, Any]) -> None:
    """The tensor-core kernel (and the reduce step when split); partitions sized without reading the device.

    ``shared`` holds the kernels' shared parameters by name (README: ``P``), ``checks`` the index-check parameters
    (``num_blocks``, ``max_seq_len``, ``error_flag``).
    """
    q, sl = shared["query"], shared["seq_lens"]
    num_tokens, max_query_len = shared["num_tokens"], shared["max_query_len"]
    num_seqs = sl.shape[0]
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = shared["num_kv_heads"]
    device = call.backend.device(device_index)
    caps = device.capabilities
    # prefill rows, a variant or strided caches
    varlen = shared["query_start_loc"] is not None or bool(_variants(call.args))
    kernels = kernels_for(call, device_index, paged_attention_tc_spec(kdtype, head_size, varlen))
    registers = int(getattr(kernels["hal_paged_attention_tc"], "attributes", {}).get("num_regs", 0))
    occupancy = paged_attention_tc_ctas_per_cu(head_size, caps.shared_mem_per_cu, caps.max_threads_per_cu,
                                               registers_per_thread=registers,
                                               registers_per_cu=caps.registers_per_cu)
    measured = getattr(device.launcher, "blocks_per_cu", None)
    if measured is not None:
        occupancy = max(1, min(occupancy, int(measured(kernels["hal_paged_attention_tc"], 128))))
    # The bound covers every valid length (the kernels flag others); partitions past a sequence's end exit at once.
    size, parts = paged_attention_tc_partitions(num_seqs, num_heads, num_kv_heads, checks["max_seq_len"],
                                                head_size, caps.compute_units, occupancy,
                                                max_query_len=max_query_len, num_tokens=num_tokens)
    plans = paged_attention_tc_launches(num_seqs, num_heads, num_kv_heads, parts, head_size, caps.compute_units,
                                        max_query_len=max_query_len, num_tokens=num_tokens)
    common = {**shared, "partition_size": size, "max_partitions": parts, **checks}
    if parts == 1:
        launch(call, device_index, kernels, plans[0],
               dict(out=out, tmp_out=None, max_logits=None, exp_sums=None, **common))
        return
    split = _split_workspaces(num_tokens, num_heads, parts, head_size)
    launch(call, device_index, kernels, plans[0], dict(out=None, **split, **common))
    reduce = kernels_for(call, device_index,
                         paged_attention_spec(kdtype, head_size, num_heads // num_kv_heads, caps.simd_width))
    launch(call, device_index, reduce, plans[1],
           dict(out=out, **split, seq_lens=sl, query_start_loc=shared["query_start_loc"], sinks=shared["sinks"],
                num_heads=num_heads, num_seqs=num_seqs, max_query_len=max_query_len, partition_size=size,
                max_partitions=parts))


def _split_workspaces(num_tokens: int, num_heads: int, parts: int, head_size: int) -> dict[str, Any]:
    """The split kernels' fp32 workspaces ``tmp_out``, ``max_logits`` and ``exp_sums`` (uninitialised)."""
    cp = cupy()
    return {"tmp_out": cp.empty((num_tokens, num_heads, parts, head_size), dtype=np.float32),
            "max_logits": cp.empty((num_tokens, num_heads, parts), dtype=np.float32),
            "exp_sums": cp.empty((num_tokens, num_heads, parts), dtype=np.float32)}


def check(call: OpCall) -> str:
    q, kc = call["query"], call["key_cache"]
    if not is_c_contiguous(q):
        return "the kernels read a C-contiguous query"
    head_size = q.shape[2]
    num_seqs = call["seq_lens"].shape[0]
    block_size = kc.shape[2]
    if head_size not in PA_HEAD_SIZES:
        return f"head_size {head_size} has no GPU kernel (built for {', '.join(map(str, PA_HEAD_SIZES))})"
    if block_size not in PA_BLOCK_SIZES:
        return f"block_size {block_size} is not one the GPU kernels are tested with ({PA_BLOCK_SIZES})"
    for name in ("key_cache", "value_cache"):  # host arrays are copied into fresh contiguous ones
        if not call.host_arrays and cache_strides(as_storage(call[name])) is None:
            return f"argument {name!r}: the kernels need non-negative strides that keep every row on 16 bytes"
    for name in ("sinks", "alibi_slopes"):
        value = getattr(call.options, name)
        if value is not None and not is_c_contiguous(value):
            return f"argument {name!r}: the kernels read a contiguous array"
    caps = call.capabilities
    if num_seqs > caps.max_grid_dims[1]:
        return f"num_seqs {num_seqs} exceeds the grid's y limit {caps.max_grid_dims[1]} on {caps.name}"
    group = q.shape[1] // kc.shape[1]
    tiles = -(-query_len_bound(call) * group // paged_attention_rows(group, query_len_bound(call)))
    if kc.shape[1] * tiles > caps.max_grid_dims[0]:
        return f"max_query_len x group needs more CTAs than the grid's x limit {caps.max_grid_dims[0]}"
    if paged_attention_partitions(seq_len_bound(call)) > caps.max_grid_dims[2]:
        return "the sequence-length bound (max_seq_len, else the block table's capacity) needs more split-KV " \
               "partitions than the grid's z limit"
    return misaligned(call, ("query", "key_cache", "value_cache", "out"))


def run(call: OpCall) -> Any:
    cp = cupy()
    query = call["query"]
    device_index = storage_device(query)
    q, kc, vc, bt, sl = (as_storage(call[n]) for n in ("query", "key_cache", "value_cache",
                                                         "block_tables", "seq_lens"))
    num_tokens, num_heads, head_size = q.shape
    num_seqs = sl.shape[0]
    num_kv_heads, block_size = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads
    max_blocks = bt.shape[1]
    hal_dtype = dtype_name(query)
    caps = call.backend.device(device_index).capabilities
    max_seq_len = seq_len_bound(call)
    prefill = is_prefill(call.args)
    max_query_len = query_len_bound(call)
    with cp.cuda.Device(device_index):
        checks = {"num_blocks": kc.shape[0], "max_seq_len": max_seq_len, "error_flag": error_flag(device_index)}
        # Rows of a sequence whose query_start_loc entries cannot place them are written by no CTA: zeros.
        out = (zeros_like_dtype if prefill else empty_like_dtype)(tuple(q.shape), hal_dtype)
        k_strides, v_strides = cache_strides(kc), cache_strides(vc)
        assert k_strides is not None and v_strides is not None  # check() refused the others
        shared = dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl,
                      query_start_loc=as_storage(call["query_start_loc"]) if prefill else None,
                      **_attention_options(call), num_heads=num_heads, num_kv_heads=num_kv_heads,
                      block_size=block_size, max_blocks_per_seq=max_blocks, num_tokens=num_tokens,
                      max_query_len=max_query_len,
                      **dict(zip(("k_stride_block", "k_stride_head", "k_stride_token"), k_strides, strict=True)),
                      **dict(zip(("v_stride_block", "v_stride_head", "v_stride_token"), v_strides, strict=True)))
        if k_strides == v_strides and uses_tensor_cores(call.backend, device_index, hal_dtype, num_heads,
                                                        num_kv_heads, head_size, prefill):
            _run_tensor_cores(call, device_index, as_storage(out), KERNEL_DTYPES[hal_dtype], shared, checks)
            return out
        rows = paged_attention_rows(group, max_query_len)
        kernels = kernels_for(call, device_index,
                              paged_attention_spec(KERNEL_DTYPES[hal_dtype], head_size, rows, caps.simd_width))
        variant = choose_paged_attention_variant(num_seqs, num_kv_heads, max_seq_len, caps.compute_units,
                                                 num_heads=num_heads, partition_size=PA_PARTITION_SIZE,
                                                 max_query_len=max_query_len, num_tokens=num_tokens,
                                                 head_size=head_size)
        plans = paged_attention_launches(variant, num_seqs, num_heads, num_kv_heads, max_seq_len,
                                         partition_size=PA_PARTITION_SIZE, max_query_len=max_query_len,
                                         num_tokens=num_tokens)
        if variant == "single":
            launch(call, device_index, kernels, plans[0], dict(out=as_storage(out), **shared, **checks))
            return out
        parts = paged_attention_partitions(max_seq_len, PA_PARTITION_SIZE)
        split = _split_workspaces(num_tokens, num_heads, parts, head_size)
        partitions = {"partition_size": PA_PARTITION_SIZE, "max_partitions": parts}
        launch(call, device_index, kernels, plans[0], dict(**split, **shared, **partitions, **checks))
        launch(call, device_index, kernels, plans[1],
               dict(out=as_storage(out), **split, seq_lens=sl, query_start_loc=shared["query_start_loc"],
                    sinks=shared["sinks"], num_heads=num_heads, num_seqs=num_seqs, max_query_len=max_query_len,
                    **partitions))
    return out


OP = GpuOp("paged_attention", check, run, specializations=specializations)
