"""Small MoE checkpoints for hal-vllm's MoE tests: a GPTQ or AWQ checkpoint and the dense one it describes.

Every weight is seeded random. The quantized checkpoint holds each
projection (attention and experts) as the format's own tensors, 4-bit in
groups of :data:`~vllm_engines.QUANT_GROUP` (as :mod:`vllm_engines` writes
a Llama's: GPTQ symmetric, words packed along K, v1 zero points stored as
``z - 1``; AWQ with zero points, packed along N); the router gate, norms,
embeddings and the head stay fp16. The dense checkpoint holds the same model with each
quantized projection dequantized (in float64, then rounded to fp16), so
vLLM's own unquantized kernels run the model the quantized checkpoint describes.
Both use the per-expert tensor names of the architecture's checkpoints
(Mixtral: ``block_sparse_moe.experts.{e}.w1/w2/w3``; Qwen3-MoE:
``mlp.experts.{e}.gate_proj/up_proj/down_proj``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm_engines import AWQ_ORDER, HEAD_SIZE, QUANT_GROUP, SEED, VOCAB, pack_along_n


@dataclass(frozen=True)
class MoeShape:
    """A MoE model's shape; the defaults are the tests' model (8 experts, top 2, hidden 128, 2 layers)."""

    hidden: int = 128
    intermediate: int = 64  # of each expert
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_size: int = HEAD_SIZE
    vocab: int = VOCAB
    max_model_len: int = 512


LAYERS = MoeShape().layers


@dataclass(frozen=True)
class Architecture:
    """Where a MoE architecture's checkpoints keep a layer's router and experts."""

    name: str  # transformers' class name
    moe: str  # the MoE block under model.layers.N
    gate_up_down: tuple[str, str, str]  # the experts' projection names
    head_norms: bool  # per-head RMSNorm of queries and keys (Qwen3)


#: The architectures the writer knows, by transformers' model type.
ARCHITECTURES = {
    # softmax, top-k, renormalised (vLLM's RenormalizeNaive)
    "mixtral": Architecture("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), False),
    # norm_topk_prob=False: softmax, top-k, not renormalised (vLLM's Default)
    "qwen3_moe": Architecture("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), True),
}


def model_config(shape: MoeShape, arch: str = "mixtral") -> dict[str, Any]:
    """The transformers config (as saved) of a model of ``shape`` and architecture ``arch``, fp16."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_size,
                  num_experts_per_tok=shape.top_k, max_position_embeddings=shape.max_model_len)
    config: Any
    if arch == "mixtral":
        config = MixtralConfig(**common, intermediate_size=shape.intermediate, num_local_experts=shape.experts,
                               sliding_window=None)
    else:
        config = Qwen3MoeConfig(**common, intermediate_size=4 * shape.intermediate,
                                moe_intermediate_size=shape.intermediate, num_experts=shape.experts,
                                norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
    saved: dict[str, Any] = config.to_dict()
    saved["architectures"] = [ARCHITECTURES[arch].name]
    saved["torch_dtype"] = saved["dtype"] = "float16"
    return saved


def _projections(rng: np.random.Generator, shape: MoeShape, arch: Architecture) -> Iterator[tuple[str, np.ndarray]]:
    """Every quantizable projection as ``[out, in]`` float32 (torch's Linear layout), by tensor-name base."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_size, shape.kv_heads * shape.head_size, shape.intermediate
    gate, up, down = arch.gate_up_down
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}"
        for name, out, inp in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            yield f"{prefix}.self_attn.{name}", _normal(rng, out, inp)
        for e in range(shape.experts):
            for name, out, inp in ((gate, i, h), (up, i, h), (down, h, i)):
                yield f"{prefix}.{arch.moe}.experts.{e}.{name}", _normal(rng, out, inp)


def _normal(rng: np.random.Generator, out: int, inp: int) -> np.ndarray:
    return (rng.standard_normal((out, inp), dtype=np.float32) / np.float32(np.sqrt(inp)))


def _rest(rng: np.random.Generator, shape: MoeShape, arch: Architecture) -> dict[str, np.ndarray]:
    """The fp16 tensors of both checkpoints: embeddings, head, norms, router gates."""
    h = shape.hidden
    tensors = {"model.embed_tokens.weight": rng.standard_normal((shape.vocab, h)),
               "lm_head.weight": _normal(rng, shape.vocab, h), "model.norm.weight": 1.0 + 0.1 * rng.standard_normal(h)}
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(h)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(h)
        tensors[f"{prefix}.{arch.moe}.gate.weight"] = _normal(rng, shape.experts, h)
        if arch.head_norms:
            for norm in ("q_norm", "k_norm"):
                tensors[f"{prefix}.self_attn.{norm}.weight"] = 1.0 + 0.1 * rng.standard_normal(shape.head_size)
    return tensors


def _pack_along_k(codes: np.ndarray) -> np.ndarray:
    """GPTQ's int32 words ``[K/8, N]``: nibble ``j`` of word ``[r, n]`` holds the code of row ``8r + j``."""
    k, n = codes.shape
    grouped = codes.reshape(k // 8, 8, n).astype(np.uint32)
    return (grouped << (4 * np.arange(8, dtype=np.uint32))[None, :, None]).sum(axis=1, dtype=np.uint32).view(np.int32)


def save_moe_checkpoints(root: Path, method: str = "gptq", shape: MoeShape = MoeShape(),
                         group_size: int = QUANT_GROUP, arch: str = "mixtral") -> tuple[Path, Path]:
    """Write the 4-bit ``method`` (``"gptq"``: symmetric; ``"awq"``: with zero points) checkpoint of a model of
    ``shape`` and architecture ``arch`` (:data:`ARCHITECTURES`; groups of ``group_size``) and its dense fp16
    twin under ``root``; returns both folders (``<method>``, ``<method>-dense``)."""
    from safetensors.torch import save_file

    from hal_core.quant import quantize

    if method not in ("gptq", "awq"):
        raise ValueError(f"method must be 'gptq' or 'awq', got {method!r}")
    architecture = ARCHITECTURES[arch]
    rng = np.random.default_rng(SEED)
    rest = _rest(rng, shape, architecture)
    fp16 = {name: torch.from_numpy(value.astype(np.float16)) for name, value in rest.items()}
    quantized, dense = dict(fp16), dict(fp16)
    for base, weight in _projections(rng, shape, architecture):
        q = quantize(weight.T, bits=4, group_size=group_size, symmetric=method == "gptq")
        k, n = q.shape
        dense[f"{base}.weight"] = torch.from_numpy(q.dequantize(np.float64).T.astype(np.float16).copy())
        quantized[f"{base}.scales"] = torch.from_numpy(q.scales.astype(np.float16))
        if method == "gptq":
            quantized[f"{base}.qweight"] = torch.from_numpy(_pack_along_k(q.codes()))
            quantized[f"{base}.qzeros"] = torch.full((k // group_size, n // 8), 0x77777777, dtype=torch.int32)
            quantized[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // group_size
        else:
            quantized[f"{base}.qweight"] = torch.from_numpy(pack_along_n(q.codes().astype(np.int64), AWQ_ORDER))
            quantized[f"{base}.qzeros"] = torch.from_numpy(pack_along_n(q.zeros.astype(np.int64), AWQ_ORDER))
    quantization = ({"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True}
                    if method == "gptq" else
                    {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                     "version": "gemm"})
    folders = (root / method, root / f"{method}-dense")
    for folder, tensors, config_entry in ((folders[0], quantized, quantization), (folders[1], dense, None)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))
        config = model_config(shape, arch)
        if config_entry is not None:
            config["quantization_config"] = config_entry
        (folder / "config.json").write_text(json.dumps(config))
    return folders
