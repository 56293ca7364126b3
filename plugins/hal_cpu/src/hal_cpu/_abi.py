"""The argument structs of the compiled kernels' C ABI (``csrc/hal_cpu_kernels.h``), mirrored once with ctypes.

A kernel entry point takes one pointer to its struct; the op wrappers fill
the mirror by field name. When the library loads, :func:`check` compares
each mirror's size and field offsets with the layout the library reports
(``hal_cpu_abi(name)``), so a stale build fails with a message saying to
rebuild instead of reading garbage.
"""

from __future__ import annotations

import ctypes

__all__ = ["STRUCTS", "AttentionArgs", "DequantTileArgs", "FromFloat32Args", "GatedActivationArgs", "MoeExpertsArgs",
           "RmsNormArgs", "RotaryEmbeddingArgs", "SampleArgs", "ToFloat32Args", "W4a16BlockedArgs", "W4a16GemvArgs",
           "W8a8GemmArgs", "WriteKvCacheArgs", "layout", "mismatch"]

_i32, _i64, _f32, _p = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class AttentionArgs(ctypes.Structure):
    """``hal_cpu_attention_args``: one variable-length paged-attention call (see the header for each field)."""

    _fields_ = [
        ("query", _p), ("q_token_stride", _i64), ("q_head_stride", _i64),
        ("key_cache", _p), ("value_cache", _p),
        ("k_block_stride", _i64), ("k_head_stride", _i64), ("k_token_stride", _i64),
        ("v_block_stride", _i64), ("v_head_stride", _i64), ("v_token_stride", _i64),
        ("block_tables", _p), ("bt_stride", _i64), ("seq_lens", _p), ("query_start_loc", _p),
        ("sinks", _p), ("alibi_slopes", _p), ("out", _p), ("out_token_stride", _i64), ("out_dtype", _i32),
        ("num_seqs", _i32), ("num_tokens", _i32), ("num_heads", _i32), ("num_kv_heads", _i32),
        ("block_size", _i32), ("head_size", _i32), ("dtype", _i32), ("max_query_len", _i32), ("window", _i32),
        ("scale", _f32), ("softcap", _f32), ("partition_tokens", _i32), ("query_tile", _i32), ("threads", _i32),
    ]


class WriteKvCacheArgs(ctypes.Structure):
    """``hal_cpu_write_kv_cache_args``: scatter new keys and values into the paged caches through a slot mapping."""

    _fields_ = [
        ("key", _p), ("k_token_stride", _i64), ("k_head_stride", _i64),
        ("value", _p), ("v_token_stride", _i64), ("v_head_stride", _i64),
        ("key_cache", _p), ("value_cache", _p),
        ("c_block_stride", _i64), ("c_head_stride", _i64), ("c_token_stride", _i64),
        ("slots", _p), ("num_tokens", _i64), ("slot_bytes", _i32), ("num_kv_heads", _i32), ("block_size", _i32),
        ("head_size", _i32), ("elem_bytes", _i32), ("threads", _i32),
    ]


class ToFloat32Args(ctypes.Structure):
    """``hal_cpu_to_float32_args``: rows of fp16/bf16/fp32 activations widened to contiguous float32."""

    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("m", _i64), ("k", _i64), ("out", _p), ("dtype", _i32), ("threads", _i32),
    ]


class FromFloat32Args(ctypes.Structure):
    """``hal_cpu_from_float32_args``: a contiguous float32 array rounded to fp16 or bf16 (numpy's bits), in parallel."""

    _fields_ = [("x", _p), ("out", _p), ("n", _i64), ("chunk", _i64), ("dtype", _i32), ("threads", _i32)]


class W4a16GemvArgs(ctypes.Structure):
    """``hal_cpu_w4a16_gemv_args``: W4A16 with the int4 codes unpacked in registers (small M)."""

    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("m", _i64), ("k", _i64), ("n", _i64),
        ("qweight", _p), ("scales", _p), ("zeros", _p), ("group_size", _i64), ("y", _p), ("n_tile", _i64),
        ("x_dtype", _i32), ("s_dtype", _i32), ("default_zero", _i32), ("k_parts", _i32), ("threads", _i32),
    ]


class DequantTileArgs(ctypes.Structure):
    """``hal_cpu_dequant_tile_args``: columns ``[n0, n1)`` of an int4 or int8 weight dequantised to float32."""

    _fields_ = [
        ("qweight", _p), ("scales", _p), ("zeros", _p), ("g_idx", _p), ("group_size", _i64),
        ("k", _i64), ("n", _i64), ("n0", _i64), ("n1", _i64), ("out", _p), ("ld", _i64),
        ("bits", _i32), ("s_dtype", _i32), ("default_zero", _i32), ("threads", _i32),
    ]


class W8a8GemmArgs(ctypes.Structure):
    """``hal_cpu_w8a8_gemm_args``: W8A8 with per-token activation quantisation fused."""

    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("m", _i64), ("k", _i64), ("n", _i64),
        ("qweight", _p), ("scales", _p), ("zeros", _p), ("perm", _p), ("group_starts", _p), ("group_of_run", _p),
        ("runs", _i64), ("y", _p), ("n_tile", _i64),
        ("x_dtype", _i32), ("s_dtype", _i32), ("default_zero", _i32), ("k_parts", _i32), ("threads", _i32),
    ]


class W4a16BlockedArgs(ctypes.Structure):
    """``hal_cpu_w4a16_blocked_args``: W4A16 as a cache-blocked GEMM on dequantised panels (large M, act-order)."""

    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("m", _i64), ("k", _i64), ("n", _i64),
        ("qweight", _p), ("scales", _p), ("zeros", _p), ("g_idx", _p), ("group_size", _i64), ("y", _p),
        ("x_dtype", _i32), ("s_dtype", _i32), ("default_zero", _i32), ("threads", _i32),
    ]


class W4a8GemmArgs(ctypes.Structure):
    """``hal_cpu_w4a8_gemm_args``: W4A8, int4 codes times per-token int8 activations summed exactly per group."""

    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("m", _i64), ("k", _i64), ("n", _i64),
        ("qweight", _p), ("scales", _p), ("zeros", _p), ("group_size", _i64), ("y", _p),
        ("x_dtype", _i32), ("s_dtype", _i32), ("default_zero", _i32), ("threads", _i32),
    ]


class SampleArgs(ctypes.Structure):
    """``hal_cpu_sample_args``: one token per row of logits (temperature, top-k, top-p, min-p, seeds)."""

    _fields_ = [
        ("logits", _p), ("logits_stride", _i64), ("temperature", _p), ("top_k", _p), ("top_p", _p), ("min_p", _p),
        ("seeds", _p), ("out", _p), ("num_seqs", _i64), ("vocab_size", _i64), ("dtype", _i32), ("threads", _i32),
    ]


class RotaryEmbeddingArgs(ctypes.Structure):
    """``hal_cpu_rotary_embedding_args``: query and key head rows rotated in place by their tokens' cos/sin rows."""

    _fields_ = [
        ("positions", _p), ("query", _p), ("q_token_stride", _i64), ("q_head_stride", _i64),
        ("key", _p), ("k_token_stride", _i64), ("k_head_stride", _i64), ("cos_sin_cache", _p),
        ("num_tokens", _i64), ("max_position", _i64), ("position_bytes", _i32), ("num_heads", _i32),
        ("num_kv_heads", _i32), ("rotary_dim", _i32), ("dtype", _i32), ("gptj", _i32), ("threads", _i32),
    ]


class RmsNormArgs(ctypes.Structure):
    """``hal_cpu_rms_norm_args``: RMSNorm of each row, with an optional fused residual add."""

    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("weight", _p), ("residual", _p), ("residual_stride", _i64),
        ("out", _p), ("out_stride", _i64), ("num_tokens", _i64), ("hidden_size", _i64), ("rows_per_task", _i64),
        ("epsilon", _f32), ("weight_offset", _f32), ("dtype", _i32), ("threads", _i32),
    ]


class GatedActivationArgs(ctypes.Structure):
    """``hal_cpu_gated_activation_args``: ``out = act(gate) * up`` row by row."""

    _fields_ = [
        ("gate", _p), ("gate_stride", _i64), ("up", _p), ("up_stride", _i64), ("out", _p), ("out_stride", _i64),
        ("num_tokens", _i64), ("intermediate_size", _i64), ("rows_per_task", _i64), ("activation", _i32),
        ("dtype", _i32), ("threads", _i32),
    ]


class ExpertMlpsArgs(ctypes.Structure):
    """``hal_cpu_expert_mlps_args``: small MoE calls, each expert's two GEMMs and activation on one thread."""

    _fields_ = [("up", _p), ("act", _p), ("down", _p), ("jobs", _i64), ("kind", _i32), ("threads", _i32)]


class MoeExpertsArgs(ctypes.Structure):
    """``hal_cpu_moe_experts_args``: a small MoE call from its routing, over the experts' kept GEMM structs."""

    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("ids", _p), ("ids_stride", _i64), ("weights", _p), ("weights_stride", _i64),
        ("out", _p), ("up", _p), ("down", _p), ("ready", _p), ("tokens", _i64), ("top_k", _i64),
        ("num_experts", _i64), ("hidden", _i64), ("intermediate_size", _i64), ("x_itemsize", _i32),
        ("max_rows", _i32), ("kind", _i32), ("activation", _i32), ("threads", _i32),
    ]


#: ``hal_cpu_expert_mlps``'s ``kind`` per GEMM kernel entry point.
EXPERT_W4A16, EXPERT_W8A8, EXPERT_W4A8 = 0, 1, 2

#: ``hal_cpu_moe_experts``'s answer when the call is not one it serves (its output untouched).
DECLINED = 2


#: ABI name (as ``hal_cpu_abi`` knows it) -> mirror.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "attention": AttentionArgs,
    "write_kv_cache": WriteKvCacheArgs,
    "to_float32": ToFloat32Args,
    "w4a16_gemv": W4a16GemvArgs,
    "dequant_tile": DequantTileArgs,
    "w8a8_gemm": W8a8GemmArgs,
    "w4a16_blocked": W4a16BlockedArgs,
    "w4a8_gemm": W4a8GemmArgs,
    "sample": SampleArgs,
    "rms_norm": RmsNormArgs,
    "gated_activation": GatedActivationArgs,
    "rotary_embedding": RotaryEmbeddingArgs,
    "from_float32": FromFloat32Args,
    "expert_mlps": ExpertMlpsArgs,
    "moe_experts": MoeExpertsArgs,
}


def layout(struct: type[ctypes.Structure]) -> str:
    """The mirror's layout in the library's format: ``size=N;field=offset:size;...``."""
    parts = [f"size={ctypes.sizeof(struct)}"]
    parts += [f"{field[0]}={getattr(struct, field[0]).offset}:{ctypes.sizeof(field[1])}" for field in struct._fields_]
    return ";".join(parts)


def mismatch(name: str, struct: type[ctypes.Structure], compiled: str | None) -> str | None:
    """Why ``struct`` does not match the library's ``compiled`` layout of ``name``, or None when it does."""
    if compiled is None:
        return f"the library does not describe struct {name!r}"
    mirror = layout(struct)
    if mirror == compiled:
        return None
    ours, theirs = dict(p.split("=", 1) for p in mirror.split(";")), dict(p.split("=", 1) for p in compiled.split(";"))
    diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    shown = ", ".join(f"{k}: library {theirs.get(k, 'missing')}, Python {ours.get(k, 'missing')}" for k in diff[:4])
    return f"struct {name!r} differs ({shown})"
