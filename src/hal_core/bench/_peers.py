"""Peers: what a user would run instead, timed on the same inputs in the same run.

On host backends: torch's ``scaled_dot_product_attention(enable_gqa=True)``
on contiguous K/V (the peer gets the easier layout; ``is_causal=True`` for a
prompt), torch's int4 CPU kernel
with bf16 activations (it is only fast with bf16), torch's int8 weight
kernel, and numpy's float32 BLAS on the dequantised weight. On device
backends: the backend array library's fp16 and bf16 matmul on the
unquantised weight (cuBLAS on CUDA). The torch eager sequences that
rms_norm, gated_activation, rotary_embedding and sample replace are in
``_step_peers``. torch is imported only when a peer is built; a missing
peer is reported, never fatal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..arrays import numpy_dtype
from ..quant import QuantizedWeight
from ._cases import Case
from ._moe_peer import MOE_PEERS
from ._peer_base import Peer, PeerUnavailable, Runner, inference, rotating, to_torch, torch_module
from ._step_peers import STEP_PEERS

__all__ = ["PEERS", "Peer", "PeerUnavailable", "peers_for"]


# -- attention ----------------------------------------------------------------


def _contiguous_kv(cache: np.ndarray, tables: np.ndarray, ctx: int) -> np.ndarray:
    """``[num_seqs, kv_heads, ctx, head]`` from the paged cache (the layout torch's SDPA wants)."""
    gathered = cache[tables]  # [seqs, blocks, kv_heads, block, head]
    seqs, blocks, heads, block, head = gathered.shape
    flat = gathered.transpose(0, 2, 1, 3, 4).reshape(seqs, heads, blocks * block, head)
    return np.ascontiguousarray(flat[:, :, :ctx])


def _torch_sdpa(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    """Decode (one query row per sequence, equal lengths) or one causal prompt, with K/V made contiguous."""
    torch = torch_module()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []
    for args in inputs:
        ctx = int(args["seq_lens"][0])
        if (args["seq_lens"] != ctx).any():
            raise PeerUnavailable("torch sdpa peer needs equal sequence lengths")
        if args.get("window") is not None:
            raise PeerUnavailable("torch sdpa has no sliding window (it would need a dense mask)")
        k = to_torch(torch, _contiguous_kv(args["key_cache"], args["block_tables"], ctx))
        v = to_torch(torch, _contiguous_kv(args["value_cache"], args["block_tables"], ctx))
        query, scale = to_torch(torch, args["query"]), args["scale"]
        if args.get("query_start_loc") is None:  # decode: [seqs, heads, 1, head]
            q, causal = query.unsqueeze(2), False
        elif query.shape[0] == ctx and len(args["seq_lens"]) == 1:  # one whole prompt: [1, heads, ctx, head]
            q, causal = query.transpose(0, 1).unsqueeze(0).contiguous(), True
        else:
            raise PeerUnavailable("torch sdpa peer runs decode batches or one whole prompt")

        def call(q: Any = q, k: Any = k, v: Any = v, scale: float = scale, causal: bool = causal) -> object:
            return sdpa(q, k, v, scale=scale, is_causal=causal, enable_gqa=True)

        calls.append(inference(torch, call))
    calls[0]()  # fails here, not while timing, when this torch cannot run it
    return rotating(calls)


# -- quantized gemm -----------------------------------------------------------


def dequantize_float32(qw: QuantizedWeight) -> np.ndarray:
    """``[K, N]`` float32 weights of a host QuantizedWeight (computed in float32, for the BLAS peer)."""
    k, n = qw.shape
    w = qw.codes().astype(np.float32)
    zeros = np.float32(qw.default_zero) if qw.zeros is None else np.asarray(qw.zeros, dtype=np.float32)[:, None, :]
    w = w.reshape(k // qw.group_size, qw.group_size, n)
    w -= zeros
    w *= np.asarray(qw.scales, dtype=np.float32)[:, None, :]
    return w.reshape(k, n)


def _torch_int4(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    torch = torch_module()
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    calls = []
    for args in inputs:
        qw: QuantizedWeight = args["qweight"]
        codes = torch.from_numpy(np.ascontiguousarray(qw.codes().T).astype(np.int32))  # [N, K]
        packed = convert(codes, 2)
        scales = torch.from_numpy(np.asarray(qw.scales, dtype=np.float32))
        scale_zero = torch.stack([scales, torch.zeros_like(scales)], dim=-1).to(torch.bfloat16).contiguous()
        x = torch.from_numpy(np.asarray(args["x"], dtype=np.float32)).to(torch.bfloat16)
        group = qw.group_size
        calls.append(inference(torch, functools.partial(mm, x, packed, group, scale_zero)))
    calls[0]()
    return rotating(calls)


def _torch_int8(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    torch = torch_module()
    mm = torch.ops.aten._weight_int8pack_mm
    calls = []
    for args in inputs:
        qw: QuantizedWeight = args["qweight"]
        codes = (qw.codes().astype(np.int16) - qw.default_zero).astype(np.int8)
        w = torch.from_numpy(np.ascontiguousarray(codes.T))  # [N, K] int8
        scales = torch.from_numpy(np.asarray(qw.scales, dtype=np.float32).max(axis=0)).to(torch.bfloat16)
        x = torch.from_numpy(np.asarray(args["x"], dtype=np.float32)).to(torch.bfloat16)
        calls.append(inference(torch, functools.partial(mm, x, w, scales)))
    calls[0]()
    return rotating(calls)


def _numpy_blas(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
    calls = []
    for args in inputs:
        w = dequantize_float32(args["qweight"])
        x = np.asarray(args["x"], dtype=np.float32)
        out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)
        calls.append(lambda x=x, w=w, out=out: np.matmul(x, w, out=out))
    return rotating(calls)


def _device_matmul(dtype: str) -> Callable[[Sequence[dict[str, Any]], Any], Runner]:
    def build(inputs: Sequence[dict[str, Any]], xp: Any) -> Runner:
        np_dtype = numpy_dtype(dtype)
        calls = []
        for args in inputs:
            try:
                w = xp.asarray(dequantize_float32(args["qweight"]).astype(np_dtype))
                x = xp.asarray(np.asarray(args["x"], dtype=np.float32).astype(np_dtype))
            except Exception as exc:  # e.g. no bf16 in this array library
                raise PeerUnavailable(f"{xp.__name__} cannot hold {dtype}: {type(exc).__name__}: {exc}") from None
            calls.append(lambda x=x, w=w: xp.matmul(x, w))
        calls[0]()
        return rotating(calls)

    return build


def _is_gemm(bits: int | None = None, host: bool = True) -> Callable[[Case, bool], bool]:
    def applies(case: Case, on_host: bool) -> bool:
        return (case.op == "quantized_gemm" and on_host == host
                and (bits is None or case.params["bits"] == bits))

    return applies


#: Every peer hal bench knows, in table order.
PEERS: tuple[Peer, ...] = (
    Peer("torch sdpa (contiguous K/V)", lambda case, host: host and case.op == "paged_attention"
         and not case.params.get("window") and (not case.params.get("prompts") or (
             case.params["prompts"] == 1 and not case.params["seqs"] and case.params["q"] == case.params["ctx"])),
         _torch_sdpa),
    Peer("torch int4 (bf16 x)", _is_gemm(4), _torch_int4),
    Peer("torch int8 (bf16 x)", _is_gemm(8), _torch_int8),
    Peer("numpy fp32 BLAS (dequantised w)", _is_gemm(), _numpy_blas),
    Peer("device matmul fp16 (unquantised w)", _is_gemm(host=False), _device_matmul("fp16")),
    Peer("device matmul bf16 (unquantised w)", _is_gemm(host=False), _device_matmul("bf16")),
    *STEP_PEERS,
    *MOE_PEERS,
)


def peers_for(case: Case, host: bool, wanted: Sequence[str] | None = None) -> list[Peer]:
    """The peers that apply to ``case`` on a host (``host=True``) or device backend."""
    found = [p for p in PEERS if p.applies(case, host)]
    if wanted is not None:
        found = [p for p in found if any(w.lower() in p.name.lower() for w in wanted)]
    return found
