"""The parameter list of every GPU kernel hal-cupy launches: ``(name, C type)`` in the kernel's order.

The one declaration of each list (see :mod:`hal_cupy._kernel_abi`): the ops
fill arguments by these names (:func:`hal_cupy.ops._common.launch`), the
loader refuses a kernel source whose signature differs (:func:`check_source`),
and a test keeps ``kernels/README.md``'s parameter tables equal to it.  Changing a
kernel's parameters means changing its entry here, its source and the
values its op passes -- each side refuses the others until they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import _kernel_abi
from ._kernel_abi import Field, fields

__all__ = ["KERNEL_PARAMS", "PA_SHARED", "check_source", "pack"]

#: The parameters every paged-attention kernel takes after its outputs (``HAL_PA_PARAMS``, README: ``P``).
PA_SHARED: tuple[Field, ...] = fields(
    ("query", "const hal_t*"), ("key_cache", "const hal_t*"), ("value_cache", "const hal_t*"),
    ("block_tables", "const int*"), ("seq_lens", "const int*"), ("query_start_loc", "const int*"),
    ("sinks", "const float*"), ("alibi_slopes", "const float*"), ("scale", "float"), ("softcap", "float"),
    ("num_heads", "int"), ("num_kv_heads", "int"), ("block_size", "int"), ("max_blocks_per_seq", "int"),
    ("window", "int"), ("num_tokens", "int"), ("max_query_len", "int"),
    ("k_stride_block", "hal_i64"), ("k_stride_head", "hal_i64"), ("k_stride_token", "hal_i64"),
    ("v_stride_block", "hal_i64"), ("v_stride_head", "hal_i64"), ("v_stride_token", "hal_i64"),
)
#: The index-check parameters closing the attention kernels' lists.
_PA_CHECKS = (("num_blocks", "int"), ("max_seq_len", "int"), ("error_flag", "int*"))
_PA_SPLIT_OUT = (("tmp_out", "float*"), ("max_logits", "float*"), ("exp_sums", "float*"))
_PARTITIONS = (("partition_size", "int"), ("max_partitions", "int"))
_GEMM_SIZES = (("M", "int"), ("N", "int"), ("K", "int"), ("group_size", "int"))
#: The grouped MoE GEMMs' row-tile arguments and sizes.
_MOE_TILES = (("sorted_pairs", "const int*"), ("tile_expert", "const int*"), ("offsets", "const int*"))
_MOE_SIZES = (("hidden", "int"), ("inter", "int"), ("group_size", "int"))
_DEQUANT_TAIL = (("scales", "const hal_u16*"), ("zeros", "const hal_u8*"), ("K", "int"), ("N", "int"),
                 ("group_size", "int"))

#: Every entry point's parameters, by kernel name.
KERNEL_PARAMS: dict[str, tuple[Field, ...]] = {
    # paged_attention.cu
    "hal_paged_attention": fields(("out", "hal_t*"), *PA_SHARED, *_PA_CHECKS),
    "hal_paged_attention_split": fields(*_PA_SPLIT_OUT, *PA_SHARED, *_PARTITIONS, *_PA_CHECKS),
    "hal_paged_attention_reduce": fields(
        ("out", "hal_t*"), ("tmp_out", "const float*"), ("max_logits", "const float*"), ("exp_sums", "const float*"),
        ("seq_lens", "const int*"), ("query_start_loc", "const int*"), ("sinks", "const float*"),
        ("num_heads", "int"), ("num_seqs", "int"), ("max_query_len", "int"), *_PARTITIONS),
    # paged_attention_tc.cu
    "hal_paged_attention_tc": fields(("out", "hal_t*"), *_PA_SPLIT_OUT, *PA_SHARED, *_PARTITIONS, *_PA_CHECKS),
    # write_kv_cache.cu
    "hal_write_kv_cache": fields(
        ("key", "const void*"), ("value", "const void*"), ("key_cache", "void*"), ("value_cache", "void*"),
        ("slot_mapping", "const hal_slot_t*"), ("num_kv_heads", "int"), ("block_size", "int"), ("row_bytes", "int"),
        ("num_blocks", "int"), ("error_flag", "int*")),
    # quant_gemm.cu
    "hal_w4a16_gemm": fields(
        ("out", "hal_t*"), ("ws", "float*"), ("x", "const hal_t*"), ("qweight", "const hal_u32*"),
        ("scales", "const hal_u16*"), ("zeros", "const hal_u8*"), *_GEMM_SIZES, ("groups_per_split", "int")),
    "hal_w8a8_gemm": fields(
        ("out", "hal_t*"), ("ws", "float*"), ("xq", "const hal_i8*"), ("sx", "const float*"),
        ("qweight", "const hal_u8*"), ("scales", "const hal_u16*"), ("zeros", "const hal_u8*"), *_GEMM_SIZES,
        ("groups_per_split", "int")),
    # quant_gemm_tc.cu
    "hal_w4a16_gemm_tc": fields(
        ("out", "hal_t*"), ("ws", "float*"), ("x", "const hal_t*"), ("qtc", "const hal_u32*"),
        ("scales", "const hal_u16*"), ("zeros", "const hal_u8*"), *_GEMM_SIZES, ("kb_per_split", "int")),
    "hal_w8a8_gemm_tc": fields(
        ("out", "hal_t*"), ("ws", "float*"), ("xq", "const hal_i8*"), ("sx", "const float*"),
        ("qtc", "const hal_u32*"), ("scales", "const hal_u16*"), ("zeros", "const hal_u8*"), *_GEMM_SIZES,
        ("kb_per_split", "int")),
    "hal_w4a8_gemm_tc": fields(
        ("out", "hal_t*"), ("ws", "float*"), ("xq", "const hal_i8*"), ("sx", "const float*"),
        ("qtc", "const hal_u32*"), ("scales", "const hal_u16*"), ("zeros", "const hal_u8*"), *_GEMM_SIZES,
        ("kb_per_split", "int")),
    "hal_tc_reduce": fields(("out", "hal_t*"), ("ws", "const float*"), ("count", "hal_i64"), ("splits", "int")),
    # quant_util.cu
    "hal_w4a16_dequant": fields(("w", "hal_t*"), ("qweight", "const hal_u32*"), *_DEQUANT_TAIL),
    "hal_w8_dequant": fields(("w", "hal_t*"), ("qweight", "const hal_u8*"), *_DEQUANT_TAIL),
    "hal_w8a8_quantize_rows": fields(("xq", "hal_i8*"), ("sx", "float*"), ("x", "const hal_t*"), ("K", "int")),
    "hal_w4a8_quantize_rows": fields(("xq", "hal_i8*"), ("sx", "float*"), ("x", "const hal_t*"), ("K", "int")),
    "hal_f32_splits_to_dtype": fields(("out", "hal_t*"), ("ws", "const float*"), ("count", "long long"),
                                      ("splits", "int")),
    "hal_f32_to_dtype": fields(("out", "hal_t*"), ("ws", "const float*"), ("count", "long long")),
    # rms_norm.cu
    "hal_rms_norm": fields(
        ("out", "void*"), ("x", "const void*"), ("weight", "const void*"), ("residual", "void*"),
        ("x_stride", "hal_i64"), ("residual_stride", "hal_i64"), ("hidden_size", "int"), ("epsilon", "float"),
        ("weight_offset", "float")),
    # gated_activation.cu
    "hal_gated_activation": fields(
        ("out", "void*"), ("gate", "const void*"), ("up", "const void*"), ("gate_stride", "hal_i64"),
        ("up_stride", "hal_i64"), ("intermediate_size", "int"), ("activation", "int")),
    # rotary_embedding.cu
    "hal_rotary_embedding": fields(
        ("positions", "const hal_pos_t*"), ("query", "hal_t*"), ("key", "hal_t*"), ("cos_sin_cache", "const float*"),
        ("q_token_stride", "hal_i64"), ("q_head_stride", "hal_i64"), ("k_token_stride", "hal_i64"),
        ("k_head_stride", "hal_i64"), ("num_heads", "int"), ("num_kv_heads", "int"), ("rotary_dim", "int"),
        ("gptj", "int"), ("max_position", "hal_i64"), ("error_flag", "int*")),
    # sample.cu
    "hal_sample": fields(
        ("logits", "const hal_t*"), ("row_stride", "hal_i64"), ("vocab", "int"), ("temperature", "const float*"),
        ("top_k", "const int*"), ("top_p", "const float*"), ("min_p", "const float*"), ("seeds", "const hal_i64*"),
        ("out", "hal_i64*"), ("error_flag", "int*")),
    # fused_moe.cu
    "hal_moe_route": fields(
        ("topk_ids", "int*"), ("topk_weights", "float*"), ("counts", "int*"), ("logits", "const float*"),
        ("num_tokens", "int"), ("num_experts", "int"), ("top_k", "int"), ("routing", "int")),
    "hal_moe_align": fields(
        ("offsets", "int*"), ("tile_expert", "int*"), ("sorted_pairs", "int*"), ("cursor", "int*"),
        ("counts", "const int*"), ("num_experts", "int"), ("max_tiles", "int")),
    "hal_moe_scatter": fields(
        ("sorted_pairs", "int*"), ("cursor", "int*"), ("topk_ids", "const int*"), ("offsets", "const int*"),
        ("num_pairs", "int")),
    "hal_moe_w4_gate_up": fields(("act", "float*"), ("x", "const hal_t*"), *_MOE_TILES, ("w13", "const hal_i64*"),
                                 *_MOE_SIZES, ("top_k", "int"), ("num_experts", "int"), ("activation", "int")),
    "hal_moe_w4_down": fields(("y", "float*"), ("act", "const float*"), *_MOE_TILES, ("w2", "const hal_i64*"),
                              *_MOE_SIZES, ("num_experts", "int")),
    "hal_moe_w8_gate_up": fields(("act", "float*"), ("xq", "const hal_i8*"), ("sx", "const float*"), *_MOE_TILES,
                                 ("w13", "const hal_i64*"), *_MOE_SIZES, ("top_k", "int"), ("num_experts", "int"),
                                 ("activation", "int")),
    "hal_moe_w8_down": fields(("y", "float*"), ("aq", "const hal_i8*"), ("sa", "const float*"), *_MOE_TILES,
                              ("w2", "const hal_i64*"), *_MOE_SIZES, ("num_experts", "int")),
    "hal_moe_w4a8_gate_up": fields(("act", "float*"), ("xq", "const hal_i8*"), ("sx", "const float*"), *_MOE_TILES,
                                   ("w13", "const hal_i64*"), *_MOE_SIZES, ("top_k", "int"), ("num_experts", "int"),
                                   ("activation", "int")),
    "hal_moe_w4a8_down": fields(("y", "float*"), ("aq", "const hal_i8*"), ("sa", "const float*"), *_MOE_TILES,
                                ("w2", "const hal_i64*"), *_MOE_SIZES, ("num_experts", "int")),
    "hal_moe_combine": fields(("out", "hal_t*"), ("y", "const float*"), ("topk_weights", "const float*"),
                              ("hidden", "int"), ("top_k", "int")),
}


def pack(kernel: str, values: Mapping[str, Any]) -> tuple[Any, ...]:
    """``kernel``'s argument tuple from ``values`` by parameter name (:func:`hal_cupy._kernel_abi.pack`)."""
    return _kernel_abi.pack(kernel, values, KERNEL_PARAMS)


def check_source(source_name: str, code: str, entry_points: Iterable[str]) -> None:
    """Refuse ``code`` when an entry point's parameters differ from :data:`KERNEL_PARAMS`
    (:func:`hal_cupy._kernel_abi.check_source`)."""
    _kernel_abi.check_source(source_name, code, entry_points, KERNEL_PARAMS)
